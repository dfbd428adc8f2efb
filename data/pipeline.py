"""Examples -> tokenised, filtered, packed or bucketed, fixed-shape numpy batches.

``make_batches`` is the one entry point for sequence data (translation, LM lines,
encoder-only); ``lm_windows`` samples fixed-length windows of one token stream
(char LMs). Both return a ``grain.IterDataset``; ``iter()`` of it is a
``grain.DatasetIterator`` whose ``get_state()`` is a small JSON-serialisable dict
and whose ``set_state(state)`` on a FRESH iterator makes the next batch equal to
the one the saved iterator would have produced.

Why custom grain iterators instead of grain's own packing/batching: grain's
``FirstFitPackIterDataset`` emits rows, not batches, and has no length bucketing.
Ours build a whole batch at a time from a random-access ``grain.MapDataset``
(shard -> per-epoch shuffle -> repeat -> tokenise -> filter, all grain), so their
state is just indices into it:

* packing: ``{"next_index": i}``, the first example not in an emitted batch;
* bucketing: also ``"bucket_starts"``, per bucket the index of its oldest
  buffered example (-1 if empty); restoring re-reads the examples from the
  oldest start, keeping those of each bucket at or after its start. That costs
  a few batches' worth of tokenisation once, instead of storing tokens in state.

Multi-host: every process reads only ``source[shard_index::shard_count]``.
Packed batches have one shape everywhere; bucketed batches have one of a few
shapes, but processes may pick different buckets at the same step, so use
packing (or per-process models) for multi-host training.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from transformer_zoo.data.bpe_dropout import BpeDropout
from transformer_zoo.data.output_vocab import TargetVocabulary
from transformer_zoo.data.packing import SEGMENTED, Batch, RowPacker, example_length, pad
from transformer_zoo.data.tokenizers import Tokenizer


class BatchMode(enum.StrEnum):
    """How `Batching` lays examples into rows."""

    PACK = "pack"  # several examples per row, first fit, with segment ids
    BUCKET = "bucket"  # one example per row, padded to its length bucket


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batching:
    """How examples become batches.

    Attributes:
      mode: a `BatchMode` (or its value): PACK (first-fit packing into rows of
        fixed length) or BUCKET (one example per row, padded to the smallest
        bucket length that fits).
      batch_size: rows per batch (pack) or examples per batch (bucket).
      tokens_per_batch: alternative to batch_size: rows = tokens_per_batch //
        row length (pack: the longest of the row lengths; bucket: the bucket length),
        rounded down to a multiple of ``rows_multiple``.
      max_inputs_length: drop examples whose inputs (with EOS) are longer; also the
        packed row length S of ``inputs``.
      max_targets_length: same for ``targets`` (row length T).
      bucket_boundaries: increasing bucket lengths; the last must be >= the max
        lengths. Default: 8, 16, 32, ... up to the longest max length.
      rows_multiple: rows per batch are a multiple of this (e.g. device count).
    """

    mode: BatchMode | str = BatchMode.PACK
    batch_size: int | None = None
    tokens_per_batch: int | None = None
    max_inputs_length: int | None = None
    max_targets_length: int | None = None
    bucket_boundaries: tuple[int, ...] | None = None
    rows_multiple: int = 1

    def __post_init__(self):
        # As models.variants.parse does; data does not import models (and flax).
        if self.mode not in BatchMode._value2member_map_:
            raise ValueError(f"Batching.mode={self.mode!r} is unknown; choose from "
                             f"{[mode.value for mode in BatchMode]}")
        object.__setattr__(self, "mode", BatchMode(self.mode))
        if (self.batch_size is None) == (self.tokens_per_batch is None):
            raise ValueError(
                "Batching: set exactly one of batch_size / tokens_per_batch, got "
                f"batch_size={self.batch_size}, tokens_per_batch={self.tokens_per_batch}")
        for name in ("batch_size", "tokens_per_batch", "max_inputs_length",
                     "max_targets_length", "rows_multiple"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Batching.{name} must be a positive int, got {value!r}")
        if self.batch_size is not None and self.batch_size % self.rows_multiple:
            raise ValueError(f"Batching.batch_size={self.batch_size} is not a multiple of "
                             f"rows_multiple={self.rows_multiple}")
        if self.bucket_boundaries is not None:
            b = self.bucket_boundaries
            if not b or any(x >= y for x, y in zip(b, b[1:], strict=False)) or b[0] < 1:
                raise ValueError(f"Batching.bucket_boundaries must be increasing positive ints, "
                                 f"got {b!r}")

    def max_lengths(self, features: Sequence[str]) -> dict[str, int]:
        """Max length per segmented feature present (ValueError if one is unset)."""
        lengths = {}
        for f in features:
            value = getattr(self, f"max_{f}_length")
            if value is None:
                raise ValueError(f"Batching.max_{f}_length must be set for examples with {f!r}")
            lengths[f] = value
        return lengths

    def rows_for_length(self, length: int) -> int:
        """Rows per batch for rows of ``length`` tokens."""
        if self.batch_size is not None:
            return self.batch_size
        rows = self.tokens_per_batch // length // self.rows_multiple * self.rows_multiple
        return max(rows, self.rows_multiple)

    def boundaries(self, max_length: int) -> tuple[int, ...]:
        """Bucket lengths covering examples up to ``max_length`` tokens."""
        if self.bucket_boundaries is not None:
            if self.bucket_boundaries[-1] < max_length:
                raise ValueError(f"Batching.bucket_boundaries[-1]={self.bucket_boundaries[-1]} "
                                 f"< max length {max_length}")
            return self.bucket_boundaries
        out, b = [], 8
        while b < max_length:
            out.append(b)
            b *= 2
        return (*out, max_length)


# ---------------------------------------------------------------------------
# Tokenising and filtering (grain MapDataset transforms, picklable).


class _Tokenize:
    """Text example -> id example: segmented features get ids + [tokenizer.eos_id]."""

    def __init__(self, tokenizer: Tokenizer, target_vocab: TargetVocabulary | None = None):
        self.tokenizer = tokenizer
        self.target_vocab = target_vocab

    def __call__(self, example: Mapping[str, Any]) -> dict[str, np.ndarray | int]:
        return self._ids(example, self.tokenizer.encode)

    def _ids(self, example: Mapping[str, Any], encode) -> dict[str, np.ndarray | int]:
        out: dict[str, Any] = {}
        for key, value in example.items():
            if key in SEGMENTED:
                ids = encode(value) if isinstance(value, str) else list(value)
                if key == "targets" and self.target_vocab is not None:
                    ids = self.target_vocab.restrict(ids)
                out[key] = np.asarray([*ids, self.tokenizer.eos_id], np.int32)
            elif key == "labels" and np.ndim(value) == 1:
                # Token labels: label 0 for the appended EOS keeps them aligned.
                out[key] = np.asarray([*value, 0], np.int32)
            else:
                out[key] = value
        return out


class _SampledTokenize(_Tokenize):
    """Like _Tokenize, with BPE-dropout: the segmentation of the example at stream
    position `index` depends only on (seed, shard, index), so a resumed iterator
    sees the same samples and every epoch new ones."""

    def __init__(self, tokenizer: Tokenizer, rate: float, seed: int, shard: int,
                 target_vocab: TargetVocabulary | None = None):
        super().__init__(tokenizer, target_vocab)
        self.sampler = BpeDropout(tokenizer, rate)
        self.key = f"bpe-dropout/{seed}/{shard}"

    def __call__(self, index: int, example: Mapping[str, Any]) -> dict[str, np.ndarray | int]:
        rng = random.Random(f"{self.key}/{index}")  # str seeds hash with sha512: stable
        return self._ids(example, lambda text: self.sampler.encode(text, rng))


class _FitsLengths:
    def __init__(self, lengths: Mapping[str, int]):
        self.lengths = dict(lengths)

    def __call__(self, example) -> bool:
        return all(example_length(example, f) <= n for f, n in self.lengths.items())


def tokenize(examples: grain.MapDataset, tokenizer: Tokenizer,
             target_vocab: TargetVocabulary | None = None) -> grain.MapDataset:
    """Maps text examples to id examples (``encode`` + ``tokenizer.eos_id``) lazily;
    with `target_vocab`, targets are spelt with its pieces (data/output_vocab.py)."""
    return examples.map(_Tokenize(tokenizer, target_vocab))


def _process_shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    if shard_index is None or shard_count is None:
        import jax  # Only for the process index/count; no transforms here.

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                         f"shard_count={shard_count}")
    return shard_index, shard_count


# ---------------------------------------------------------------------------
# Batch iterators.


class _BatchIterator(grain.DatasetIterator):
    """Reads a MapDataset by index, skipping filtered (None) elements."""

    def __init__(self, source: grain.MapDataset, batching: Batching, lengths: dict[str, int],
                 epoch: int):
        super().__init__()
        self._source = source
        self._size = len(source)  # sys.maxsize when repeating forever.
        self._batching = batching
        self._lengths = lengths
        self._epoch = epoch  # examples per pass
        self._skipped = 0  # filtered out in a row
        self._next = 0

    def _read(self, index: int):
        example = self._source[index]
        self._skipped = self._skipped + 1 if example is None else 0
        # A whole pass filtered out: repeating it forever would hang.
        if self._skipped >= self._epoch and self._size > self._epoch:
            raise ValueError(f"no example of {self._epoch} fits the length limits "
                             f"{self._lengths} (tokens with EOS); raise them")
        return example


class _PackIterator(_BatchIterator):
    def __next__(self) -> Batch:
        rows = self._batching.rows_for_length(max(self._lengths.values()))
        packer = RowPacker(rows, self._lengths)
        while self._next < self._size:
            example = self._read(self._next)
            if example is not None and not packer.add(example):
                break  # Batch full; this example starts the next one.
            self._next += 1
        if not packer.num_examples:
            raise StopIteration
        return packer.batch()

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next}

    def set_state(self, state: dict[str, Any]) -> None:
        self._next = int(state["next_index"])


class _BucketIterator(_BatchIterator):
    def __init__(self, source, batching, lengths, epoch):
        super().__init__(source, batching, lengths, epoch)
        self._bounds = batching.boundaries(max(lengths.values()))
        self._buffers: list[list] = [[] for _ in self._bounds]
        self._starts = [-1] * len(self._bounds)

    def _bucket(self, example) -> int:
        length = max(example_length(example, f) for f in SEGMENTED)
        return int(np.searchsorted(self._bounds, length))

    def _take(self, bucket: int) -> Batch:
        length = self._bounds[bucket]
        batch = pad(self._buffers[bucket], self._batching.rows_for_length(length), length)
        self._buffers[bucket], self._starts[bucket] = [], -1
        return batch

    def __next__(self) -> Batch:
        while self._next < self._size:
            index, example = self._next, self._read(self._next)
            self._next += 1
            if example is None:
                continue
            b = self._bucket(example)
            if not self._buffers[b]:
                self._starts[b] = index
            self._buffers[b].append(example)
            if len(self._buffers[b]) == self._batching.rows_for_length(self._bounds[b]):
                return self._take(b)
        # Finite data exhausted: flush partial buckets, padded with empty rows.
        for b, buffer in enumerate(self._buffers):
            if buffer:
                return self._take(b)
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next, "bucket_starts": list(self._starts)}

    def set_state(self, state: dict[str, Any]) -> None:
        starts = [int(s) for s in state["bucket_starts"]]
        if len(starts) != len(self._bounds):
            raise ValueError(f"state has {len(starts)} buckets, this pipeline has "
                             f"{len(self._bounds)} ({self._bounds})")
        self._next, self._starts = int(state["next_index"]), starts
        self._buffers = [[] for _ in self._bounds]
        live = [s for s in starts if s >= 0]
        for index in range(min(live, default=self._next), self._next):
            example = self._read(index)
            if example is None:
                continue
            b = self._bucket(example)
            if 0 <= starts[b] <= index:
                self._buffers[b].append(example)


class _BatchDataset(grain.IterDataset):
    def __init__(self, source: grain.MapDataset, batching: Batching, lengths: dict[str, int],
                 epoch: int):
        super().__init__()
        self._source, self._batching, self._lengths = source, batching, lengths
        self._epoch = epoch

    def __iter__(self) -> grain.DatasetIterator:
        cls = _PackIterator if self._batching.mode == BatchMode.PACK else _BucketIterator
        return cls(self._source, self._batching, self._lengths, self._epoch)


def make_batches(
    examples: grain.MapDataset,
    batching: Batching,
    *,
    tokenizer: Tokenizer | None = None,
    train: bool,
    seed: int = 0,
    shard_index: int | None = None,
    shard_count: int | None = None,
    prefetch: int = 0,
    bpe_dropout: float = 0.0,
    target_vocab: TargetVocabulary | None = None,
) -> grain.IterDataset:
    """Batches of token ids from text (or id) examples.

    Args:
      examples: text examples from sources.py / synthetic.py (``inputs`` and/or
        ``targets`` strings, optional ``labels``), or id examples if ``tokenizer``
        is None.
      batching: shapes, sizes and mode.
      tokenizer: encodes ``inputs``/``targets``; its ``eos_id`` is appended.
      train: True: shuffle every epoch (from ``seed``) and repeat forever;
        False: one pass in order, last batch padded with empty rows.
      seed: shuffling seed.
      shard_index, shard_count: this process's shard (default: jax process
        index/count); the process reads only ``examples[shard_index::shard_count]``.
      prefetch: batches prepared ahead in a background thread (grain's
        ThreadPrefetchIterDataset; its state still points after the last batch
        *returned*, so resume stays exact). 0 = none.
      bpe_dropout: train only, sentencepiece BPE ``tokenizer`` only: the rate at
        which each merge is dropped (data/bpe_dropout.py); example i of the
        stream is segmented from (seed, shard_index, i). 0 = the model's own
        segmentation.
      target_vocab: with a ``tokenizer``, spell ``targets`` with this target
        side's pieces only (``data.output_vocab='target_side'``; the model's
        ``output_ids`` are its ids). None = the tokenizer's own ids.

    Returns:
      An IterDataset of batch dicts (see packing.py); its iterators are
      checkpointable with get_state/set_state.
    """
    if not isinstance(examples, grain.MapDataset):
        raise TypeError(f"examples must be a grain.MapDataset, got {type(examples).__name__}")
    if len(examples) == 0:
        raise ValueError("make_batches: examples is empty")
    if target_vocab is not None and tokenizer is None:
        raise ValueError("make_batches: target_vocab spells tokenized targets; it needs a "
                         "tokenizer (the examples are ids already)")
    shard_index, shard_count = _process_shard(shard_index, shard_count)
    features = [f for f in SEGMENTED if f in examples[0]]
    lengths = batching.max_lengths(features)
    ds = examples[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} is empty ({len(examples)} examples)")
    epoch = len(ds)
    if train:
        ds = ds.shuffle(seed=seed).repeat()  # grain reshuffles each epoch.
    if bpe_dropout:
        if not train or tokenizer is None:
            raise ValueError(f"bpe_dropout={bpe_dropout} samples training text: it needs "
                             f"train=True and a tokenizer (got train={train}, tokenizer="
                             f"{type(tokenizer).__name__})")
        ds = ds.map_with_index(_SampledTokenize(tokenizer, bpe_dropout, seed, shard_index,
                                                target_vocab))
    elif tokenizer is not None:
        ds = tokenize(ds, tokenizer, target_vocab)
    ds = ds.filter(_FitsLengths(lengths))
    batches = _BatchDataset(ds, batching, lengths, epoch)
    if prefetch:
        batches = grain.experimental.ThreadPrefetchIterDataset(
            batches, prefetch_buffer_size=prefetch)
    return batches


# ---------------------------------------------------------------------------
# Windows of one token stream (char LMs on a contiguous corpus).


class _RandomWindows:
    def __init__(self, ids: np.ndarray, length: int, rows: int, seed: int, shard: int):
        self.ids, self.length, self.rows, self.seed, self.shard = ids, length, rows, seed, shard

    def __call__(self, step: int) -> Batch:
        rng = np.random.default_rng([self.seed, self.shard, int(step)])
        starts = rng.integers(0, len(self.ids) - self.length + 1, size=self.rows)
        return _window_batch(self.ids, starts, self.length, self.rows)


class _SequentialWindows:
    def __init__(self, ids: np.ndarray, length: int, rows: int, windows: np.ndarray):
        self.ids, self.length, self.rows, self.windows = ids, length, rows, windows

    def __call__(self, step: int) -> Batch:
        starts = self.windows[step * self.rows:(step + 1) * self.rows] * self.length
        return _window_batch(self.ids, starts, self.length, self.rows)


def _window_batch(ids: np.ndarray, starts: np.ndarray, length: int, rows: int) -> Batch:
    targets = np.zeros((rows, length), np.int32)
    segmentation = np.zeros((rows, length), np.int32)
    for r, start in enumerate(starts):
        targets[r] = ids[start:start + length]
        segmentation[r] = 1
    position = np.where(segmentation > 0, np.arange(length, dtype=np.int32), 0).astype(np.int32)
    return {"targets": targets, "targets_segmentation": segmentation,
            "targets_position": position}


def lm_windows(
    token_ids: np.ndarray,
    *,
    length: int,
    batch_size: int,
    train: bool,
    seed: int = 0,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.IterDataset:
    """Batches of ``length``-token windows of one token stream (``targets`` only).

    Train: each row a uniformly random window; batch k depends only on (seed,
    shard, k), so the state is grain's element index. Eval: consecutive
    non-overlapping windows (the remainder shorter than ``length`` is dropped),
    dealt round-robin to shards; the last batch is padded with empty rows.
    Rows are whole windows: segmentation 1, positions 0..length-1.
    """
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim != 1 or len(ids) < length:
        raise ValueError(f"token_ids must be 1-D with >= length={length} tokens, got shape "
                         f"{ids.shape}")
    for name, value in (("length", length), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"lm_windows: {name} must be a positive int, got {value!r}")
    shard_index, shard_count = _process_shard(shard_index, shard_count)
    if train:
        steps = grain.MapDataset.range(sys.maxsize)
        fn = _RandomWindows(ids, length, batch_size, seed, shard_index)
    else:
        windows = np.arange(len(ids) // length)[shard_index::shard_count]
        steps = grain.MapDataset.range(-(-len(windows) // batch_size))
        fn = _SequentialWindows(ids, length, batch_size, windows)
    return steps.map(fn).to_iter_dataset()

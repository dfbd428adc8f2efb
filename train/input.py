"""From the run config's `data` section to a tokenizer and batch iterators.

The tokenizer is built once and stored in WORKDIR/tokenizer; a resumed run and
decoding reload it from there, so ids never change under a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_zoo import data
from transformer_zoo.configs import schema
from transformer_zoo.train.cli import missing_data_file
from transformer_zoo.train.tasks import Family, get_task

TASKS = tuple(schema.DATA_TASKS)


@dataclasses.dataclass
class Input:
    """What the loop consumes.

    Attributes:
      tokenizer: encodes/decodes text (saved in the workdir).
      train: an infinite IterDataset of batches; its iterator has get/set_state.
      eval_batches: returns a fresh finite iterable of held-out batches.
      eval_examples: held-out text examples ({"inputs", "targets"}) for
        decoding metrics (exact match or BLEU); empty for LM/classification.
      test_examples: test examples decoded once at the end (data.test_source/
        test_target; never used for selection).
      long_eval_batches: None, or held-out batches of data.long_eval_length
        tokens per row, scored once at the end.
      target_vocab: data.output_vocab='target_side': the training targets'
        pieces (the model's output_ids), with which every target is spelt;
        None = all of the tokenizer's.
    """

    tokenizer: Any
    train: grain.IterDataset
    eval_batches: Callable[[], Iterable[dict]]
    eval_examples: list[dict]
    test_examples: list[dict] = dataclasses.field(default_factory=list)
    long_eval_batches: Callable[[], Iterable[dict]] | None = None
    target_vocab: data.TargetVocabulary | None = None

    @property
    def output_ids(self) -> tuple[int, ...] | None:
        """The ids the decoder's output layer scores (None = all)."""
        return None if self.target_vocab is None else self.target_vocab.ids


def tokenizer_dir(workdir) -> Path:
    return Path(workdir) / "tokenizer"


def copy_tokenizer(source_workdir, target_workdir) -> bool:
    """Copies the source workdir's saved tokenizer into a target that has none yet
    (what decoding or fine-tuning the target needs); True if it copied."""
    theirs, ours = tokenizer_dir(source_workdir), tokenizer_dir(target_workdir)
    if not (theirs / "tokenizer.json").is_file() or (ours / "tokenizer.json").exists():
        return False
    shutil.copytree(theirs, ours, dirs_exist_ok=True)
    return True


def build_input(config, workdir) -> Input:
    """The Input of `config.data` (the fields of each task: configs/schema.py DATA_TASKS).

    Raises:
      ValueError: an unknown family or task, a key that is not one of the task's
        fields, or a text task outside decoder_only (before anything is read).
    """
    d = schema.data_fields(config.data)
    family = get_task(config.family).family  # ValueError for an unknown family
    if d.task in ("text_file", "tfds_text") and family != Family.DECODER_ONLY:
        raise ValueError(f"data.task={d.task!r} needs family='decoder_only', "
                         f"got {config.family!r}")
    if d.get("bpe_dropout") and d.spm_model_type != data.SpmModelType.BPE:
        raise ValueError(f"data.bpe_dropout={d.bpe_dropout} needs data.spm_model_type='bpe', "
                         f"got {d.spm_model_type!r}")
    return _BUILDERS[d.task](d, config.seed, Path(workdir))


def per_process(global_size: int, name: str) -> int:
    """This process's share of a global batch size (`data.batch_size` etc. are global)."""
    procs = jax.process_count()
    if global_size % procs:
        raise ValueError(f"data.{name}={global_size} is a global batch size and must be a "
                         f"multiple of the {procs} processes")
    return global_size // procs


def _row_lengths(d) -> dict[str, int | None]:
    """The max lengths the task declares (a classification task has no targets)."""
    return {k: d[k] for k in ("max_inputs_length", "max_targets_length") if k in d}


def _batching(d, train: bool) -> data.Batching:
    kw = _row_lengths(d)
    if train and d.tokens_per_batch:
        return data.Batching(mode=d.batching, **kw,
                             tokens_per_batch=per_process(d.tokens_per_batch, "tokens_per_batch"))
    if train:
        return data.Batching(mode=d.batching, batch_size=per_process(d.batch_size, "batch_size"),
                             **kw)
    # Eval: one example per row, easy to score. Across processes every batch must
    # have one shape (the step is a collective), so there is one bucket: the max length.
    size = per_process(d.eval_batch_size or d.batch_size, "eval_batch_size")
    lengths = [n for n in kw.values() if n]
    single = (max(lengths),) if jax.process_count() > 1 and lengths else None
    return data.Batching(mode="bucket", batch_size=size, bucket_boundaries=single, **kw)


def _seq2seq_input(d, seed: int, train_ds, eval_ds, tokenizer, num_decode: int,
                   target_vocab: data.TargetVocabulary | None = None) -> Input:
    """Batches of a task of examples; the first `num_decode` held-out ones are decoded."""
    train = data.make_batches(train_ds, _batching(d, True), tokenizer=tokenizer, train=True,
                              seed=seed, bpe_dropout=d.get("bpe_dropout", 0.0),
                              target_vocab=target_vocab)
    eval_ds = eval_ds[: d.max_eval_examples] if d.max_eval_examples else eval_ds

    def eval_batches():
        return data.make_batches(eval_ds, _batching(d, False), tokenizer=tokenizer, train=False,
                                 target_vocab=target_vocab)

    n = min(num_decode, len(eval_ds))
    return Input(tokenizer, train, eval_batches, _examples(eval_ds, n), target_vocab=target_vocab)


def _target_vocab(d, seed: int, train_ds, tokenizer) -> data.TargetVocabulary | None:
    """data.output_vocab='target_side': the pieces of the training targets (all of them,
    or data.spm_max_sentences drawn with the run's seed where there are more), else None."""
    if data.OutputVocab(d.output_vocab) == data.OutputVocab.ALL:
        return None
    n = len(train_ds)
    rows = (range(n) if n <= d.spm_max_sentences else
            np.sort(np.random.default_rng(seed).choice(n, d.spm_max_sentences, replace=False)))
    return data.TargetVocabulary.build(tokenizer, (train_ds[int(i)]["targets"] for i in rows))


def _examples(ds, n: int | None = None) -> list[dict]:
    """The first n (default all) examples of a random-access dataset, as a list."""
    return [ds[i] for i in range(len(ds) if n is None else n)]


def _saved_or(workdir: Path, make: Callable[[], Any]):
    """The tokenizer stored in the workdir, else `make()` saved there.

    Across processes, process 0 builds and saves first; the others then load it
    (shared workdir) or build the same tokenizer themselves (per-host disks), so
    no two processes write one file at the same time.
    """
    directory = tokenizer_dir(workdir)
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            tokenizer = _load_or_make(directory, make)
        multihost_utils.sync_global_devices("tokenizer saved by process 0")
        if jax.process_index() != 0:
            tokenizer = _load_or_make(directory, make)
        return tokenizer
    return _load_or_make(directory, make)


def _load_or_make(directory: Path, make: Callable[[], Any]):
    if (directory / "tokenizer.json").exists():
        return data.load_tokenizer(directory)
    tokenizer = make()
    _save_atomically(tokenizer, directory)
    return tokenizer


def _save_atomically(tokenizer, directory: Path) -> None:
    """tokenizer.save(directory), so that a kill at any moment leaves either no
    tokenizer.json (the next run makes the tokenizer again) or a complete one.

    The files are written to a sibling staging directory and moved in one by
    one with os.replace (atomic), tokenizer.json, which marks a saved tokenizer,
    last.
    """
    staging = directory.with_name(f"{directory.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save(staging)
    directory.mkdir(parents=True, exist_ok=True)
    for name in sorted((p.name for p in staging.iterdir()), key=lambda n: n == "tokenizer.json"):
        os.replace(staging / name, directory / name)
    staging.rmdir()


def _numbers(d, seed: int, workdir: Path) -> Input:
    tokenizer = _saved_or(workdir, data.number_tokenizer)
    train = data.number_words("train", num_examples=d.num_train_examples, seed=seed)
    test = data.number_words("test", num_examples=d.num_eval_examples, seed=seed + 1)
    return _seq2seq_input(d, seed, train, test, tokenizer, d.num_decode_examples)


def _sentencepiece(d, seed: int, workdir: Path, train_ds):
    def make():
        # Both sides of translation pairs (one joint vocabulary); LM examples have targets.
        texts = data.sample_texts(train_ds, max_examples=d.spm_max_sentences, seed=seed)
        return data.train_sentencepiece(
            texts, tokenizer_dir(workdir), vocab_size=d.vocab_size, model_type=d.spm_model_type,
            character_coverage=d.spm_character_coverage, byte_fallback=d.spm_byte_fallback)

    return _saved_or(workdir, make)


def _require(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(missing_data_file(what, p))
    return p


def _parallel_files(d, seed: int, workdir: Path) -> Input:
    train = data.parallel_files(_require(d.train_source, "data.train_source"),
                                _require(d.train_target, "data.train_target"))
    evals = data.parallel_files(_require(d.eval_source, "data.eval_source"),
                                _require(d.eval_target, "data.eval_target"))
    tokenizer = _sentencepiece(d, seed, workdir, train)
    inp = _seq2seq_input(d, seed, train, evals, tokenizer, d.num_decode_examples,
                         _target_vocab(d, seed, train, tokenizer))
    if d.test_source:
        test = data.parallel_files(_require(d.test_source, "data.test_source"),
                                   _require(d.test_target, "data.test_target"))
        inp.test_examples = _examples(test)
    return inp


def _tfds_translation(d, seed: int, workdir: Path) -> Input:
    kw = dict(source_key=d.source_key, target_key=d.target_key, data_dir=d.tfds_data_dir)
    train = data.tfds_translation(d.tfds_name, d.train_split, **kw)
    evals = data.tfds_translation(d.tfds_name, d.eval_split, **kw)
    tokenizer = _sentencepiece(d, seed, workdir, train)
    inp = _seq2seq_input(d, seed, train, evals, tokenizer, d.num_decode_examples,
                         _target_vocab(d, seed, train, tokenizer))
    if d.test_split:
        test = data.tfds_translation(d.tfds_name, d.test_split, **kw)
        inp.test_examples = _examples(test)
    return inp


def _lm_input(d, seed: int, train_ids: np.ndarray, eval_ids: np.ndarray, tokenizer) -> Input:
    rows = per_process(d.batch_size, "batch_size")
    train = data.lm_windows(train_ids, length=d.seq_length, batch_size=rows, train=True,
                            seed=seed)

    def eval_batches():
        ds = data.lm_windows(eval_ids, length=d.seq_length, batch_size=rows, train=False)
        return ds if not d.max_eval_batches else _take(ds, d.max_eval_batches)

    inp = Input(tokenizer, train, eval_batches, [])
    long_length = d.get("long_eval_length")
    if long_length:
        if len(eval_ids) < long_length:  # found now, not after training
            raise ValueError(f"data.long_eval_length={long_length} is longer than the held-out "
                             f"text ({len(eval_ids)} tokens)")
        inp.long_eval_batches = lambda: data.lm_windows(eval_ids, length=long_length,
                                                        batch_size=rows, train=False)
    return inp


def _take(ds, n):
    it = iter(ds)
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def _text_file(d, seed: int, workdir: Path) -> Input:
    text = data.text_corpus(_require(d.path, "data.path"))
    split = int(len(text) * d.train_fraction)
    tokenizer = _saved_or(workdir, lambda: data.CharTokenizer.build([text[:split]]))
    ids = np.asarray(tokenizer.encode(text), np.int32)
    inp = _lm_input(d, seed, ids[:split], ids[split:], tokenizer)  # may refuse the lengths
    logging.info("char corpus: %d characters, %d train", len(text), split)
    return inp


def _tfds_text(d, seed: int, workdir: Path) -> Input:
    kw = dict(text_key=d.text_key, data_dir=d.tfds_data_dir)
    train = data.tfds_text(d.tfds_name, d.train_split, **kw)
    evals = data.tfds_text(d.tfds_name, d.eval_split, **kw)
    tokenizer = _sentencepiece(d, seed, workdir, train)
    batching = data.Batching(mode=d.batching, batch_size=per_process(d.batch_size, "batch_size"),
                             max_targets_length=d.seq_length)
    train_b = data.make_batches(train, batching, tokenizer=tokenizer, train=True, seed=seed,
                                bpe_dropout=d.bpe_dropout)

    def eval_batches():
        ds = evals[: d.max_eval_examples or len(evals)]
        return data.make_batches(ds, batching, tokenizer=tokenizer, train=False)

    return Input(tokenizer, train_b, eval_batches, [])


def _sorted(d, seed: int, workdir: Path) -> Input:
    tokenizer = _saved_or(workdir, lambda: data.symbol_tokenizer(d.num_symbols))
    train = data.sorted_classification(num_examples=d.num_train_examples, seed=seed,
                                       num_symbols=d.num_symbols)
    test = data.sorted_classification(num_examples=d.num_eval_examples, seed=seed + 1,
                                      num_symbols=d.num_symbols)
    return _seq2seq_input(d, seed, train, test, tokenizer, num_decode=0)  # labels, no text


_BUILDERS = {
    "numbers": _numbers,
    "parallel_files": _parallel_files,
    "tfds_translation": _tfds_translation,
    "text_file": _text_file,
    "tfds_text": _tfds_text,
    "sorted": _sorted,
}

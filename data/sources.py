"""Text sources: tensorflow-datasets (without TensorFlow) and local files.

Every source is a ``grain.MapDataset`` (random access, known length) of text
examples, dicts of normalised strings:

* translation: ``{"inputs": source_text, "targets": target_text}``
* language modelling: ``{"targets": text}``

``pipeline.py`` tokenises, filters and batches them; synthetic tasks live in
``synthetic.py`` and produce the same dicts.

TFDS data is read through ``tfds.data_source`` (ArrayRecord random access), so
training never imports TensorFlow. Preparing a dataset (download + convert) is a
one-off step that, for the legacy WMT builders, needs the optional ``[prepare]``
extra (TensorFlow), e.g.::

    pip install -e '.[prepare]'
    tfds build wmt14_translate/de-en --file_format=array_record

after which ``tfds_translation("wmt14_translate/de-en", "train")`` reads it with
no TensorFlow installed.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Sequence

import grain

from transformer_zoo.data.tokenizers import normalize_text

log = logging.getLogger(__name__)

PathLike = str | os.PathLike


# ---------------------------------------------------------------------------
# Local files.


def _read_lines(path: PathLike) -> list[str]:
    """Decoded, normalised lines of a UTF-8 file (empty lines kept as "")."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file not found: {path!r}")
    lines = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: line {number}: invalid UTF-8 at byte {e.start}: {e.reason}"
                ) from None
            lines.append(text)
    return lines


def _log_skipped(what: str, skipped: int, total: int) -> None:
    if skipped:
        log.warning("%s: skipped %d empty lines of %d", what, skipped, total)


def parallel_files(source_path: PathLike, target_path: PathLike) -> grain.MapDataset:
    """A translation corpus from two line-aligned UTF-8 files.

    Lines are normalised (``normalize_text``); pairs where either side is empty
    are skipped and counted in one log line.

    Raises:
      FileNotFoundError: a file is missing (message names the path).
      ValueError: invalid UTF-8 or different line counts (names file and line).
    """
    sources, targets = _read_lines(source_path), _read_lines(target_path)
    if len(sources) != len(targets):
        short, long_, n = (
            (source_path, target_path, len(sources))
            if len(sources) < len(targets)
            else (target_path, source_path, len(targets))
        )
        raise ValueError(
            f"misaligned parallel files: {os.fspath(source_path)!r} has {len(sources)} lines, "
            f"{os.fspath(target_path)!r} has {len(targets)}; {os.fspath(long_)!r} line {n + 1} "
            f"has no counterpart in {os.fspath(short)!r}"
        )
    pairs = _nonempty_pairs(zip(sources, targets, strict=True))
    _log_skipped(f"{os.fspath(source_path)} + {os.fspath(target_path)}",
                 len(sources) - len(pairs), len(sources))
    return grain.MapDataset.source(pairs)


def tsv_file(path: PathLike) -> grain.MapDataset:
    """A translation corpus from one UTF-8 file of ``source<TAB>target`` lines.

    Raises:
      FileNotFoundError: the file is missing.
      ValueError: invalid UTF-8 or a non-empty line without exactly one tab.
    """
    raw_pairs = []
    for number, line in enumerate(_read_lines(path), start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            raw_pairs.append(("", ""))
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(
                f"{os.fspath(path)}: line {number}: expected 2 tab-separated fields "
                f"(source, target), got {len(fields)}"
            )
        raw_pairs.append((fields[0], fields[1]))
    pairs = _nonempty_pairs(raw_pairs)
    _log_skipped(os.fspath(path), len(raw_pairs) - len(pairs), len(raw_pairs))
    return grain.MapDataset.source(pairs)


def _nonempty_pairs(raw_pairs) -> list[dict[str, str]]:
    pairs = []
    for source, target in raw_pairs:
        source, target = normalize_text(source), normalize_text(target)
        if source and target:
            pairs.append({"inputs": source, "targets": target})
    return pairs


def text_files(paths: PathLike | Sequence[PathLike]) -> grain.MapDataset:
    """A language-modelling corpus: one example per non-empty (normalised) line.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: invalid UTF-8 (names file and line).
    """
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not paths:
        raise ValueError("text_files: paths is empty")
    examples, total = [], 0
    for path in paths:
        lines = _read_lines(path)
        total += len(lines)
        examples.extend({"targets": t} for t in map(normalize_text, lines) if t)
    _log_skipped(", ".join(map(os.fspath, paths)), total - len(examples), total)
    return grain.MapDataset.source(examples)


def text_corpus(paths: PathLike | Sequence[PathLike]) -> str:
    """The raw contents of UTF-8 files, concatenated (for char LMs).

    Only NFC-normalised: newlines and spacing are part of what a char LM learns.
    """
    import unicodedata

    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    return "".join(unicodedata.normalize("NFC", "".join(_read_lines(p))) for p in paths)


# ---------------------------------------------------------------------------
# tensorflow-datasets (read without TensorFlow).


def _tfds():
    # Imported lazily so that using local or synthetic data needs no tfds import.
    import tensorflow_datasets as tfds

    # The legacy translate builders (wmt*) are only registered once their module
    # is imported; importing them does not import TensorFlow.
    import tensorflow_datasets.translate  # noqa: F401

    return tfds


def _to_text(value) -> str:
    return normalize_text(value.decode("utf-8") if isinstance(value, bytes) else str(value))


class _TranslationExample:
    """Picklable map fn (grain may move map fns to worker processes)."""

    def __init__(self, source_key: str, target_key: str):
        self.source_key, self.target_key = source_key, target_key

    def __call__(self, record) -> dict[str, str]:
        return {"inputs": _to_text(record[self.source_key]),
                "targets": _to_text(record[self.target_key])}


class _TextExample:
    def __init__(self, text_key: str):
        self.text_key = text_key

    def __call__(self, record) -> dict[str, str]:
        return {"targets": _to_text(record[self.text_key])}


def tfds_translation(
    name: str,
    split: str,
    *,
    source_key: str | None = None,
    target_key: str | None = None,
    data_dir: str | None = None,
    download: bool = False,
) -> grain.MapDataset:
    """A tfds translate dataset, e.g. "wmt14_translate/de-en", as text pairs.

    Args:
      name: tfds name with config ("wmt17_translate/de-en", "ted_hrlr_translate/pt_to_en").
      split: tfds split ("train", "validation", "test", "train[:1%]", ...).
      source_key, target_key: feature keys of the two languages; default: the
        builder config's ``language_pair`` in order (wmt "de-en" -> de to en; pass
        source_key="en", target_key="de" for the paper's English-to-German).
      data_dir: tfds data directory (default: tfds' own).
      download: let tfds download and prepare if missing (may need TensorFlow).
    """
    tfds = _tfds()
    builder = tfds.builder(name, data_dir=data_dir)
    pair = getattr(builder.builder_config, "language_pair", None)
    keys = list(builder.info.features.keys()) if pair is None else list(pair)
    if source_key is None or target_key is None:
        if len(keys) != 2:
            raise ValueError(f"{name}: cannot infer source/target keys from features {keys}")
        source_key = source_key or keys[0]
        target_key = target_key or keys[1]
    for field, key in (("source_key", source_key), ("target_key", target_key)):
        if key not in keys:
            raise ValueError(f"{name}: {field}={key!r} is not one of its languages {keys}")
    source = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    return grain.MapDataset.source(source).map(_TranslationExample(source_key, target_key))


def tfds_text(
    name: str,
    split: str,
    *,
    text_key: str = "text",
    data_dir: str | None = None,
    download: bool = False,
) -> grain.MapDataset:
    """A tfds dataset with a text feature (e.g. "lm1b") as LM examples."""
    tfds = _tfds()
    source = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    if len(source) and text_key not in source[0]:
        raise ValueError(f"{name}: text_key={text_key!r} not in features {list(source[0])}")
    return grain.MapDataset.source(source).map(_TextExample(text_key))


# ---------------------------------------------------------------------------
# Helpers.


def sample_texts(
    dataset: grain.MapDataset,
    *,
    keys: Sequence[str] = ("inputs", "targets"),
    max_examples: int = 500_000,
    seed: int = 0,
) -> Iterator[str]:
    """Yields the ``keys`` texts of at most ``max_examples`` random examples.

    Reads examples one by one by random index, so a tokenizer can be trained on
    a uniform sample of WMT without loading the corpus. Pass both keys for a joint
    source+target vocabulary.
    """
    n = len(dataset)
    indices = range(n) if n <= max_examples else sorted(random.Random(seed).sample(range(n),
                                                                              max_examples))
    for i in indices:
        example = dataset[i]
        for key in keys:
            if key in example:
                yield example[key]

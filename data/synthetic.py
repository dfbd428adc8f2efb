"""Synthetic tasks generated in-process (no download), deterministic from a seed.

* ``number_words``: digits -> English words, "1204" -> "one thousand two hundred
  four", numbers 0..999_999 (``MAX_NUMBER``). Words follow American style without
  "and" or hyphens ("twenty one"). The source is char level (digits), the target
  word level over a 30-word vocabulary (``number_tokenizer``), so it needs cross
  attention but stays small enough for a tiny Transformer on a CPU. This is the
  project's embedded default task.
* ``symbol_task``: copy / reverse / sort a random sequence of letters.
* ``sorted_classification``: encoder-only task, label 1 iff the letters are sorted.

Examples are text dicts like every other source (see sources.py) and are made
on access, element ``i`` from ``(seed, i)``, so datasets of any size cost no memory.
"""

from __future__ import annotations

import itertools
import string

import grain
import numpy as np

from transformer_zoo.data.tokenizers import WordCharTokenizer

MAX_NUMBER = 999_999
_ONES = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen",
)
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
NUMBER_WORDS = (*_ONES, *_TENS, "hundred", "thousand")
DIGITS = tuple(string.digits)
LETTERS = tuple(string.ascii_lowercase)
# Numbers below this are always training data: the words for 0..99 are the task's
# lexicon, a model cannot guess "seven" for 7 without seeing it.
_ALWAYS_TRAIN_BELOW = 100
_SPLITS = ("train", "test")


def number_to_words(n: int) -> str:
    """English words for ``0 <= n <= MAX_NUMBER``, e.g. 1204 -> "one thousand two hundred four"."""
    if not isinstance(n, int | np.integer) or not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"number_to_words: n must be an int in [0, {MAX_NUMBER}], got {n!r}")
    n = int(n)
    if n == 0:
        return "zero"
    thousands, rest = divmod(n, 1000)
    words = []
    if thousands:
        words += _below_thousand(thousands) + ["thousand"]
    if rest:
        words += _below_thousand(rest)
    return " ".join(words)


def _below_thousand(n: int) -> list[str]:
    hundreds, rest = divmod(n, 100)
    words = [_ONES[hundreds], "hundred"] if hundreds else []
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(_TENS[tens - 2])
        if ones:
            words.append(_ONES[ones])
    elif rest:
        words.append(_ONES[rest])
    return words


def number_split(n: int, *, test_per_mille: int = 100, split_seed: int = 0) -> str:
    """Which split ("train"/"test") number ``n`` belongs to, by a hash of ``n``."""
    if n < _ALWAYS_TRAIN_BELOW:
        return "train"
    return "test" if _mix(n, split_seed) % 1000 < test_per_mille else "train"


def _mix(n: int, seed: int) -> int:
    """splitmix64 finaliser: a stable (not Python's salted ``hash``) integer hash."""
    x = (n * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class _NumberExample:
    """Element ``i``: a number with a uniformly drawn digit count (1..6), so short
    numbers are as common as long ones, redrawn until it is in ``split``."""

    def __init__(self, split: str, seed: int, test_per_mille: int, split_seed: int):
        self.split, self.seed = split, seed
        self.test_per_mille, self.split_seed = test_per_mille, split_seed

    def __call__(self, i: int) -> dict[str, str]:
        # Pure-Python hashing instead of a numpy Generator per element: ~50x faster,
        # and the data must keep up with a tiny model's CPU training steps.
        for attempt in itertools.count():
            h = _mix(int(i) << 16 | attempt, self.seed + 0x5EED)
            digits = 1 + h % 6
            low = 0 if digits == 1 else 10 ** (digits - 1)
            n = low + (h >> 8) % (10**digits - low)
            if number_split(n, test_per_mille=self.test_per_mille,
                            split_seed=self.split_seed) == self.split:
                return {"inputs": str(n), "targets": number_to_words(n)}
        raise AssertionError("unreachable")


def number_words(
    split: str = "train",
    *,
    num_examples: int = 100_000,
    seed: int = 0,
    test_per_mille: int = 100,
    split_seed: int = 0,
) -> grain.MapDataset:
    """The digits -> words task: ``{"inputs": "1204", "targets": "one thousand ..."}``.

    The train and test splits contain disjoint sets of numbers (a hash of the
    number decides; 0..99 are always train), so test accuracy measures
    generalisation to unseen numbers.

    Args:
      split: "train" or "test".
      num_examples: length of the dataset (numbers may repeat within a split).
      seed: sampling seed; use different seeds for, e.g., validation and test.
      test_per_mille: share of numbers >= 100 held out, in 1/1000.
      split_seed: seed of the hash; keep it fixed so splits stay comparable.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if not 0 < test_per_mille < 1000:
        raise ValueError(f"test_per_mille must be in (0, 1000), got {test_per_mille}")
    _check_positive(num_examples=num_examples)
    return grain.MapDataset.range(num_examples).map(
        _NumberExample(split, seed, test_per_mille, split_seed))


def number_tokenizer() -> WordCharTokenizer:
    """The fixed joint vocabulary of the number task: 30 words + 10 digits (44 ids)."""
    return WordCharTokenizer(NUMBER_WORDS, DIGITS)


def symbol_tokenizer(num_symbols: int = 26) -> WordCharTokenizer:
    """Word-level vocabulary of the first ``num_symbols`` letters."""
    _check_symbols(num_symbols)
    return WordCharTokenizer(LETTERS[:num_symbols])


class _SymbolExample:
    def __init__(self, task, seed, min_length, max_length, num_symbols):
        self.task, self.seed = task, seed
        self.min_length, self.max_length, self.num_symbols = min_length, max_length, num_symbols

    def __call__(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, int(i)])
        length = int(rng.integers(self.min_length, self.max_length + 1))
        symbols = rng.integers(0, self.num_symbols, size=length)
        if self.task == "classify_sorted":
            # Half of the examples sorted by construction, else the label is ~always 0.
            label = int(rng.integers(0, 2))
            if label:
                symbols = np.sort(symbols)
            label = int(bool(np.all(symbols[:-1] <= symbols[1:])))
            return {"inputs": _letters(symbols), "labels": label}
        target = {"copy": symbols, "reverse": symbols[::-1], "sort": np.sort(symbols)}[self.task]
        return {"inputs": _letters(symbols), "targets": _letters(target)}


def _letters(symbols) -> str:
    return " ".join(LETTERS[s] for s in symbols)


def symbol_task(
    task: str,
    *,
    num_examples: int = 100_000,
    seed: int = 0,
    min_length: int = 1,
    max_length: int = 20,
    num_symbols: int = 10,
) -> grain.MapDataset:
    """Copy / reverse / sort random letter sequences: ``{"inputs": "c a b", "targets": ...}``.

    Use ``symbol_tokenizer(num_symbols)``; use another ``seed`` for held-out data.
    """
    if task not in ("copy", "reverse", "sort"):
        raise ValueError(f"task must be 'copy', 'reverse' or 'sort', got {task!r}")
    return _symbol_dataset(task, num_examples, seed, min_length, max_length, num_symbols)


def sorted_classification(
    *,
    num_examples: int = 100_000,
    seed: int = 0,
    min_length: int = 2,
    max_length: int = 20,
    num_symbols: int = 10,
) -> grain.MapDataset:
    """Encoder-only task: ``{"inputs": "a c c", "labels": 1}``, label 1 iff sorted."""
    return _symbol_dataset("classify_sorted", num_examples, seed, min_length, max_length,
                           num_symbols)


def _symbol_dataset(task, num_examples, seed, min_length, max_length, num_symbols):
    _check_symbols(num_symbols)
    _check_positive(num_examples=num_examples, min_length=min_length)
    if max_length < min_length:
        raise ValueError(f"max_length={max_length} must be >= min_length={min_length}")
    return grain.MapDataset.range(num_examples).map(
        _SymbolExample(task, seed, min_length, max_length, num_symbols))


def _check_symbols(num_symbols: int) -> None:
    if not 1 <= num_symbols <= len(LETTERS):
        raise ValueError(f"num_symbols must be in [1, {len(LETTERS)}], got {num_symbols}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")

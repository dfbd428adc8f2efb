"""Synthetic tasks: correct targets, determinism, disjoint splits."""

import pytest

from transformer_zoo.data import (
    MAX_NUMBER,
    number_split,
    number_to_words,
    number_tokenizer,
    number_words,
    sorted_classification,
    symbol_task,
    symbol_tokenizer,
)


def _items(ds):
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("n, words", [
    (0, "zero"),
    (7, "seven"),
    (13, "thirteen"),
    (20, "twenty"),
    (40, "forty"),
    (99, "ninety nine"),
    (105, "one hundred five"),
    (110, "one hundred ten"),
    (1000, "one thousand"),
    (1204, "one thousand two hundred four"),
    (90_017, "ninety thousand seventeen"),
    (500_000, "five hundred thousand"),
    (1_000_000 - 1, "nine hundred ninety nine thousand nine hundred ninety nine"),
])
def test_number_to_words(n, words):
    assert number_to_words(n) == words


def test_number_to_words_rejects_out_of_range():
    with pytest.raises(ValueError, match="999999"):
        number_to_words(MAX_NUMBER + 1)
    with pytest.raises(ValueError):
        number_to_words(-1)


def test_number_task_deterministic_correct_and_disjoint():
    train = _items(number_words("train", num_examples=3000, seed=0))
    assert train == _items(number_words("train", num_examples=3000, seed=0))
    assert train != _items(number_words("train", num_examples=3000, seed=1))
    test = _items(number_words("test", num_examples=1000, seed=0))
    train_numbers = {int(e["inputs"]) for e in train}
    test_numbers = {int(e["inputs"]) for e in test}
    assert not train_numbers & test_numbers
    assert all(number_split(n) == "test" for n in test_numbers)
    assert len(test_numbers) > 500  # Mostly distinct, varied numbers.
    for e in train[:200] + test[:200]:
        assert e["targets"] == number_to_words(int(e["inputs"]))
    # Digit counts are stratified: short numbers are common too.
    assert sum(len(e["inputs"]) <= 2 for e in train) > 600


def test_number_tokenizer_round_trip_and_levels():
    tok = number_tokenizer()
    assert tok.vocab_size == 4 + 30 + 10
    assert len(tok.encode("1204")) == 4  # Char-level source.
    assert len(tok.encode("one thousand two hundred four")) == 5  # Word-level target.
    for n in (0, 7, 1204, 999_999):
        for text in (str(n), number_to_words(n)):
            assert tok.decode(tok.encode(text)) == text


def test_symbol_tasks():
    for task, fn in (("copy", list), ("reverse", lambda s: s[::-1]), ("sort", sorted)):
        examples = _items(symbol_task(task, num_examples=50, seed=2, max_length=12))
        assert examples == _items(symbol_task(task, num_examples=50, seed=2, max_length=12))
        for e in examples:
            assert e["targets"].split() == fn(e["inputs"].split())
            assert 1 <= len(e["inputs"].split()) <= 12
    tok = symbol_tokenizer(10)
    assert tok.decode(tok.encode("c a j")) == "c a j"
    with pytest.raises(ValueError, match="task"):
        symbol_task("shuffle")


def test_sorted_classification_labels():
    examples = _items(sorted_classification(num_examples=200, seed=0))
    labels = [e["labels"] for e in examples]
    assert 60 < sum(labels) < 140  # Balanced-ish.
    for e in examples:
        s = e["inputs"].split()
        assert e["labels"] == int(s == sorted(s))

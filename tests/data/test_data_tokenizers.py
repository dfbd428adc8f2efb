"""Tokenizers: fixed special ids, round trips, save/load, sentencepiece reuse."""

import os

import numpy as np
import pytest

from transformer_zoo.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    CharTokenizer,
    SentencePieceTokenizer,
    WordCharTokenizer,
    load_tokenizer,
    normalize_text,
    train_sentencepiece,
)

_WORDS = (
    "der", "die", "das", "Hund", "Katze", "läuft", "schläft", "schnell", "über", "Straße",
    "the", "a", "dog", "cat", "runs", "sleeps", "quickly", "across", "street", "big", "small",
)


def _corpus(n=300):
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(_WORDS, size=rng.integers(3, 9))) + " ." for _ in range(n)]


def test_special_ids_are_fixed():
    assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)


@pytest.mark.parametrize("model_type, vocab_size", [("bpe", 120), ("unigram", 80)])
def test_sentencepiece_train_round_trip_and_reuse(tmp_path, model_type, vocab_size):
    directory = tmp_path / model_type
    tok = train_sentencepiece(_corpus(), directory, vocab_size=vocab_size, model_type=model_type)
    sp = tok._sp
    assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert sp.id_to_piece(0) == "<pad>" and sp.id_to_piece(1) == "</s>"
    assert 20 < tok.vocab_size <= vocab_size
    text = "der\u00a0Hund\tläuft über  die Straße ."
    ids = tok.encode(text)
    assert EOS_ID not in ids and PAD_ID not in ids and UNK_ID not in ids
    assert tok.decode(ids) == normalize_text(text)
    # decode stops at EOS and skips PAD/BOS, as it would on model output.
    assert tok.decode([BOS_ID, *ids, EOS_ID, *ids, PAD_ID]) == normalize_text(text)
    # A second call reuses the saved model instead of retraining (different corpus ignored).
    mtime = os.path.getmtime(directory / "spm.model")
    again = train_sentencepiece(["zzz"], directory, vocab_size=vocab_size, model_type=model_type)
    assert os.path.getmtime(directory / "spm.model") == mtime
    assert again.encode(text) == ids
    loaded = load_tokenizer(directory)
    assert isinstance(loaded, SentencePieceTokenizer) and loaded.encode(text) == ids


def test_sentencepiece_byte_fallback(tmp_path):
    tok = train_sentencepiece(_corpus(), tmp_path, vocab_size=400, byte_fallback=True)
    text = "der Hund 猫"  # Unseen character: bytes, not UNK.
    ids = tok.encode(text)
    assert UNK_ID not in ids and tok.decode(ids) == text


def test_sentencepiece_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(_corpus(), tmp_path, vocab_size=100, model_type="word")
    with pytest.raises(ValueError, match="vocab_size"):
        train_sentencepiece(_corpus(), tmp_path, vocab_size=3)


def test_char_tokenizer_round_trip_save_load(tmp_path):
    corpus = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    tok = CharTokenizer.build([corpus])
    assert tok.vocab_size == 4 + len(set(corpus))
    ids = tok.encode(corpus)
    assert min(ids) == 4  # ids start after the specials.
    assert tok.decode(ids) == corpus  # Char LMs keep newlines: no normalisation.
    assert tok.decode(tok.encode("Q")) == "\u2047" and tok.encode("Q") == [UNK_ID]
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, CharTokenizer) and loaded.encode(corpus) == ids


def test_word_char_tokenizer_save_load(tmp_path):
    tok = WordCharTokenizer(["one", "two"], ["1", "2"])
    assert tok.encode("one  two") == [4, 5] and tok.encode("12") == [6, 7]
    assert tok.decode([6, 7, EOS_ID, 4]) == "12"
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).encode("two 21") == [5, 7, 6]
    with pytest.raises(FileNotFoundError, match="no tokenizer saved"):
        load_tokenizer(tmp_path / "missing")

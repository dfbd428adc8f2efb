"""BPE-dropout: at rate 0 exactly sentencepiece's own BPE encoding (id for id, on
Multi30k when it is there, on text the model cannot cover, with and without byte
fallback); above 0 a finer segmentation of the same text, drawn only from the
seed; in the pipeline, resumed == uninterrupted and new samples every epoch."""

import json
import random

import grain
import numpy as np
import pytest

from transformer_zoo.configs.paths import SHARED_DATA
from transformer_zoo.data import (
    Batching,
    BpeDropout,
    CharTokenizer,
    make_batches,
    normalize_text,
    train_sentencepiece,
    unpack,
)

_WORDS = ("der", "die", "das", "Hund", "Katze", "läuft", "schläft", "schnell", "über",
          "Straße", "the", "a", "dog", "cat", "runs", "sleeps", "quickly", "across", "street",
          "big", "small", "Spielplatz", "playground", "Feuerwehrmann", "firefighter")
MULTI30K = SHARED_DATA / "multi30k"


def _corpus(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=rng.integers(3, 9))) + rng.choice([" .", "!", ""])
            for _ in range(n)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_sentencepiece(_corpus(), tmp_path_factory.mktemp("bpe"), vocab_size=120)


# Unseen words, characters the model never saw (a run of them is one unknown id in
# sentencepiece), extra and odd whitespace, digits, an empty line.
_HARD = ["Der Hund   läuft\tüber die Straße.", "Ω unbekannt 你好 😀😀 x", "  ", "",
         "firefighters' playgrounds, 12 dogs!!", "ÜBER Straßen-Katze"]


def _rate0_equals_sentencepiece(tokenizer, texts):
    sampler = BpeDropout(tokenizer, 0.0)
    for text in texts:
        assert sampler.encode(text, random.Random(0)) == tokenizer.encode(text), text


def test_rate_zero_is_the_models_own_segmentation(bpe):
    _rate0_equals_sentencepiece(bpe, _corpus(200, seed=1) + _HARD)


def test_rate_zero_with_byte_fallback(tmp_path):
    tokenizer = train_sentencepiece(_corpus(), tmp_path, vocab_size=400, byte_fallback=True)
    _rate0_equals_sentencepiece(tokenizer, _corpus(50, seed=2) + _HARD)
    assert len(tokenizer.encode("😀")) > 1  # the bytes, not one unknown id


@pytest.mark.skipif(not (MULTI30K / "train.de").is_file(), reason=f"{MULTI30K} not found")
def test_rate_zero_on_multi30k(tmp_path):
    lines = [line for side in ("en", "de")
             for line in (MULTI30K / f"train.{side}").read_text("utf-8").splitlines()[:4000]]
    tokenizer = train_sentencepiece(lines, tmp_path, vocab_size=3000)
    _rate0_equals_sentencepiece(tokenizer, lines[::4] + _HARD)


def test_sampled_segmentations_spell_the_same_text_more_finely(bpe):
    sampler = BpeDropout(bpe, 0.3)
    texts = _corpus(100, seed=3)
    rng = random.Random("a")
    sampled = [sampler.encode(t, rng) for t in texts]
    for text, ids in zip(texts, sampled, strict=True):
        assert bpe.decode(ids) == normalize_text(text)
        assert len(ids) >= len(bpe.encode(text))
    assert sum(map(len, sampled)) > 1.2 * sum(len(bpe.encode(t)) for t in texts)
    # Drawn from the generator alone: the same seed, the same samples; another, others.
    rng = random.Random("a")
    assert [sampler.encode(t, rng) for t in texts] == sampled
    rng = random.Random("b")
    assert [sampler.encode(t, rng) for t in texts] != sampled
    # Each merge is dropped with the rate: near 1 almost every word stays in letters.
    letters = BpeDropout(bpe, 0.999).encode("Feuerwehrmann", random.Random(1))
    assert len(letters) >= len("Feuerwehrmann") - 1


def test_what_it_cannot_reproduce_is_refused(bpe, tmp_path):
    unigram = train_sentencepiece(_corpus(), tmp_path, vocab_size=120, model_type="unigram")
    for tokenizer, rate, message in [
            (unigram, 0.1, "needs a sentencepiece BPE model, got model type 'unigram'"),
            (CharTokenizer.build(["abc"]), 0.1, "got CharTokenizer"),
            (bpe, 1.0, "rate must be in [0, 1), got 1.0"),
            (bpe, -0.1, "rate must be in [0, 1), got -0.1"),
            (bpe, True, "rate must be in [0, 1), got True")]:
        with pytest.raises(ValueError) as e:
            BpeDropout(tokenizer, rate)
        assert message in str(e.value)


def _batches(tokenizer, rate, **kw):
    pairs = [{"inputs": t, "targets": u} for t, u in zip(_corpus(60, 4), _corpus(60, 5),
                                                          strict=True)]
    return make_batches(grain.MapDataset.source(pairs), Batching(
        mode="pack", batch_size=4, max_inputs_length=32, max_targets_length=32),
        tokenizer=tokenizer, shard_index=0, shard_count=1, bpe_dropout=rate, **kw)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _segmentations(tokenizer, batches) -> dict[str, set[tuple[int, ...]]]:
    """Per target text in `batches`, the distinct id sequences it came as."""
    seen: dict[str, set[tuple[int, ...]]] = {}
    for example in (e for b in batches for e in unpack(b)):
        ids = tuple(int(i) for i in example["targets"])
        assert ids[-1] == tokenizer.eos_id
        seen.setdefault(tokenizer.decode(ids), set()).add(ids)
    return seen


def test_pipeline_resumes_exactly_and_samples_anew_each_epoch(bpe):
    reference = _take(iter(_batches(bpe, 0.2, train=True, seed=7)), 30)  # > 2 epochs
    for k in (3, 11):
        it = iter(_batches(bpe, 0.2, train=True, seed=7))
        _take(it, k)
        fresh = iter(_batches(bpe, 0.2, train=True, seed=7))
        fresh.set_state(json.loads(json.dumps(it.get_state())))
        for a, b in zip(_take(fresh, 30 - k), reference[k:], strict=True):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    texts = {normalize_text(t) for t in _corpus(60, 5)}
    sampled = _segmentations(bpe, reference)
    assert set(sampled) <= texts and len(sampled) > 40
    # Seen in several epochs, a sentence comes segmented in several ways...
    assert sum(len(ways) > 1 for ways in sampled.values()) > len(sampled) / 2
    # ... where rate 0 gives each its one segmentation, the model's own.
    plain = _segmentations(bpe, _take(iter(_batches(bpe, 0.0, train=True, seed=7)), 30))
    assert plain == {t: {(*bpe.encode(t), bpe.eos_id)} for t in plain}
    other_seed = _segmentations(bpe, _take(iter(_batches(bpe, 0.2, train=True, seed=8)), 30))
    assert any(other_seed[t] != sampled[t] for t in set(sampled) & set(other_seed))


def test_pipeline_refuses_dropout_outside_training(bpe):
    with pytest.raises(ValueError, match="bpe_dropout=0.1 samples training text: it needs "
                                         "train=True"):
        _batches(bpe, 0.1, train=False)

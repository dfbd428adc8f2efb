"""Batching: determinism, resume == uninterrupted, sharding, shapes, validation."""

import json

import grain
import numpy as np
import pytest

from transformer_zoo.data import (
    PAD_ID,
    Batching,
    CharTokenizer,
    lm_windows,
    make_batches,
    number_tokenizer,
    number_words,
    unpack,
)

TRANSLATION = Batching(mode="pack", batch_size=4, max_inputs_length=8, max_targets_length=24)


def _pairs(n=300):
    """Distinct translation pairs of varied lengths (so shards/buckets are checkable)."""
    rng = np.random.default_rng(1)
    return [{"inputs": f"{i} " + "ab" * int(rng.integers(0, 6)),
             "targets": "xy " * int(rng.integers(0, 9)) + str(i)} for i in range(n)]


def _char_tok():
    return CharTokenizer.build(["0123456789 abxy"])


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def _translation(batching, **kw):
    return make_batches(grain.MapDataset.source(_pairs()), batching, tokenizer=_char_tok(),
                        shard_index=0, shard_count=1, **kw)


def _lm(batching, **kw):
    lines = [{"targets": p["targets"] + " " + p["inputs"]} for p in _pairs()]
    return make_batches(grain.MapDataset.source(lines), batching, tokenizer=_char_tok(),
                        shard_index=0, shard_count=1, **kw)


CASES = {
    "translation-pack": (_translation, TRANSLATION),
    "translation-bucket": (_translation, Batching(
        mode="bucket", tokens_per_batch=96, max_inputs_length=8, max_targets_length=24,
        bucket_boundaries=(8, 12, 16, 24))),
    "translation-pack-prefetch": (lambda b, **kw: _translation(b, prefetch=2, **kw),
                                  TRANSLATION),
    "lm-pack": (_lm, Batching(mode="pack", batch_size=3, max_targets_length=32)),
    "lm-bucket": (_lm, Batching(mode="bucket", batch_size=4, max_targets_length=32)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_seed_same_batches_and_resume_equals_uninterrupted(name):
    build, batching = CASES[name]
    # 30 batches cross an epoch boundary (300 examples), so reshuffling is covered.
    reference = _take(iter(build(batching, train=True, seed=3)), 30)
    _assert_batches_equal(reference, _take(iter(build(batching, train=True, seed=3)), 30))
    other = _take(iter(build(batching, train=True, seed=4)), 2)
    assert any(not np.array_equal(a["targets"], b["targets"])
               for a, b in zip(other, reference, strict=False))
    for k in (5, 17):
        it = iter(build(batching, train=True, seed=3))
        _take(it, k)
        state = json.loads(json.dumps(it.get_state()))  # Must survive JSON.
        if batching.mode == "bucket":
            # Meaningful only if some bucket holds buffered examples at the save.
            assert any(s >= 0 for s in state["bucket_starts"]), state
        fresh = iter(build(batching, train=True, seed=3))
        fresh.set_state(state)
        _assert_batches_equal(_take(fresh, 30 - k), reference[k:])


def test_lm_windows_resume_and_shapes():
    ids = np.arange(4, 504)
    ds = lambda: lm_windows(ids, length=16, batch_size=4, train=True, seed=0,
                            shard_index=0, shard_count=1)
    reference = _take(iter(ds()), 6)
    b = reference[0]
    assert b["targets"].shape == (4, 16) and sorted(b) == [
        "targets", "targets_position", "targets_segmentation"]
    # Each row is a contiguous window of the stream.
    assert np.all(np.diff(b["targets"], axis=1) == 1)
    np.testing.assert_array_equal(b["targets_position"][0], np.arange(16))
    assert np.all(b["targets_segmentation"] == 1)
    it = iter(ds())
    _take(it, 2)
    fresh = iter(ds())
    fresh.set_state(json.loads(json.dumps(it.get_state())))
    _assert_batches_equal(_take(fresh, 4), reference[2:])


def test_lm_windows_eval_covers_stream_once():
    ids = np.arange(4, 4 + 100)
    batches = list(lm_windows(ids, length=10, batch_size=3, train=False,
                              shard_index=0, shard_count=1))
    assert len(batches) == 4  # 10 windows in rows of 3 -> last batch has 1 real row.
    real = np.concatenate([b["targets"][b["targets_segmentation"][:, 0] == 1] for b in batches])
    np.testing.assert_array_equal(real.ravel(), ids)
    assert np.all(batches[-1]["targets"][1:] == PAD_ID)


def _eval_examples(batching, shard_index, shard_count):
    ds = make_batches(grain.MapDataset.source(_pairs()), batching, tokenizer=_char_tok(),
                      train=False, shard_index=shard_index, shard_count=shard_count)
    return [tuple(e["inputs"]) + (-1,) + tuple(e["targets"]) for b in ds for e in unpack(b)]


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_two_shards_partition_the_data(mode):
    batching = Batching(mode=mode, batch_size=4, max_inputs_length=16, max_targets_length=32)
    everything = _eval_examples(batching, 0, 1)
    shard0, shard1 = _eval_examples(batching, 0, 2), _eval_examples(batching, 1, 2)
    assert len(everything) == len(set(everything)) == 300  # Eval: every example exactly once.
    assert not set(shard0) & set(shard1)
    assert sorted(shard0 + shard1) == sorted(everything)


def test_length_filter_and_fixed_shapes():
    batching = Batching(mode="bucket", tokens_per_batch=64, rows_multiple=4,
                        max_inputs_length=8, max_targets_length=16)
    batches = list(make_batches(grain.MapDataset.source(_pairs()), batching, tokenizer=_char_tok(),
                                train=False, shard_index=0, shard_count=1))
    shapes = {b["targets"].shape for b in batches}
    assert shapes == {(8, 8), (4, 16)}  # rows = 64 // length, multiple of 4.
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape
        assert b["targets"].dtype == np.int32
        # Unpacked rows: segmentation 1 exactly on tokens, positions = arange there.
        np.testing.assert_array_equal(b["targets_segmentation"], (b["targets"] != PAD_ID))
        lengths = (b["targets"] != PAD_ID).sum(1, keepdims=True)
        np.testing.assert_array_equal(
            b["targets_position"], np.where(np.arange(16)[: b["targets"].shape[1]] < lengths,
                                            np.arange(b["targets"].shape[1]), 0))
    kept = [e for b in batches for e in unpack(b)]
    # _pairs targets have up to 8*3 + 3 + EOS tokens; longer than 16 must be gone.
    assert 0 < len(kept) < 300 and max(len(e["targets"]) for e in kept) <= 16


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_training_data_that_no_example_fits_is_an_error_not_a_hang(mode):
    batching = Batching(mode=mode, batch_size=4, max_inputs_length=2, max_targets_length=2)
    it = iter(_translation(batching, train=True))
    with pytest.raises(ValueError, match="no example of 300 fits the length limits"):
        next(it)


def test_number_task_batches_end_to_end():
    tok = number_tokenizer()
    batching = Batching(mode="pack", batch_size=8, max_inputs_length=8, max_targets_length=16)
    batch = next(iter(make_batches(number_words("train", num_examples=50), batching,
                                   tokenizer=tok, train=True, shard_index=0, shard_count=1)))
    for ex in unpack(batch):
        assert tok.decode(ex["targets"]) and ex["inputs"][-1] == 1 and ex["targets"][-1] == 1


def test_bad_batching_arguments():
    with pytest.raises(ValueError, match="mode"):
        Batching(mode="sorted", batch_size=2)
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        Batching(batch_size=2, tokens_per_batch=100)
    with pytest.raises(ValueError, match="rows_multiple"):
        Batching(batch_size=6, rows_multiple=4)
    with pytest.raises(ValueError, match="max_targets_length"):
        _translation(Batching(batch_size=2, max_inputs_length=8), train=True)
    with pytest.raises(ValueError, match="shard_index=2"):
        make_batches(grain.MapDataset.source(_pairs()), TRANSLATION, tokenizer=_char_tok(),
                     train=True, shard_index=2, shard_count=2)
    with pytest.raises(TypeError, match="MapDataset"):
        make_batches(_pairs(), TRANSLATION, train=True, shard_index=0, shard_count=1)

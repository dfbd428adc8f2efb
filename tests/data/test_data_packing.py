"""Packing, padding and unpack: hand-written layouts and round trips."""

import numpy as np
import pytest

from transformer_zoo.data import EOS_ID, pack, pad, unpack


def _ex(inputs=None, targets=None, labels=None):
    ex = {}
    if inputs is not None:
        ex["inputs"] = np.asarray(inputs, np.int32)
    if targets is not None:
        ex["targets"] = np.asarray(targets, np.int32)
    if labels is not None:
        ex["labels"] = labels if np.ndim(labels) == 0 else np.asarray(labels, np.int32)
    return ex


def _assert_examples_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)


def test_pack_hand_written_layout():
    examples = [
        _ex([5, 6, EOS_ID], [7, EOS_ID]),
        _ex([8, EOS_ID], [9, 10, 11, EOS_ID]),
        _ex([12, 13, 14, EOS_ID], [15, EOS_ID]),
    ]
    batch = pack(examples, num_rows=2, lengths={"inputs": 6, "targets": 6})
    # First-fit: ex0 and ex1 share row 0 (3+2 <= 6 inputs, 2+4 <= 6 targets), ex2 needs row 1.
    np.testing.assert_array_equal(batch["inputs"], [[5, 6, 1, 8, 1, 0], [12, 13, 14, 1, 0, 0]])
    np.testing.assert_array_equal(batch["inputs_segmentation"],
                                  [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["inputs_position"],
                                  [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(batch["targets"], [[7, 1, 9, 10, 11, 1], [15, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["targets_segmentation"],
                                  [[1, 1, 2, 2, 2, 2], [1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["targets_position"],
                                  [[0, 1, 0, 1, 2, 3], [0, 1, 0, 0, 0, 0]])
    assert all(v.dtype == np.int32 for v in batch.values())
    assert sorted(batch) == sorted(f + s for f in ("inputs", "targets")
                                   for s in ("", "_segmentation", "_position"))


def test_pack_unpack_round_trip_random():
    rng = np.random.default_rng(0)
    examples = [
        _ex(rng.integers(4, 50, rng.integers(1, 8)).tolist() + [EOS_ID],
            rng.integers(4, 50, rng.integers(1, 10)).tolist() + [EOS_ID])
        for _ in range(40)
    ]
    batch = pack(examples, num_rows=16, lengths={"inputs": 16, "targets": 20})
    assert batch["inputs_segmentation"].max() > 1  # Something was actually packed.
    got = unpack(batch)
    key = lambda e: (tuple(e["inputs"]), tuple(e["targets"]))
    assert sorted(map(key, got)) == sorted(map(key, examples))


def test_pack_round_trip_token_labels_and_lm():
    examples = [_ex([5, 6, 1], labels=[1, 2, 0]), _ex([7, 1], labels=[3, 0])]
    batch = pack(examples, num_rows=1, lengths={"inputs": 8})
    np.testing.assert_array_equal(batch["labels"], [[1, 2, 0, 3, 0, 0, 0, 0]])
    _assert_examples_equal(unpack(batch), examples)
    lm = [_ex(targets=[4, 5, 1]), _ex(targets=[6, 1])]
    batch = pack(lm, num_rows=1, lengths={"targets": 5})
    assert "inputs" not in batch
    _assert_examples_equal(unpack(batch), lm)


def test_pad_unpacked_rows_and_scalar_labels():
    examples = [_ex([5, 6, 1], labels=1), _ex([7, 1], labels=0)]
    batch = pad(examples, num_rows=3, length=4)
    np.testing.assert_array_equal(batch["inputs_segmentation"],
                                  [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["inputs_position"],
                                  [[0, 1, 2, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["labels"], [1, 0, 0])
    _assert_examples_equal(unpack(batch), examples)


def test_packing_rejects_scalar_labels_and_overlong():
    with pytest.raises(ValueError, match="cannot be packed"):
        pack([_ex([5, 1], labels=1)], num_rows=1, lengths={"inputs": 4})
    with pytest.raises(ValueError, match="inputs of length 5 exceeds"):
        pack([_ex([5, 5, 5, 5, 1])], num_rows=1, lengths={"inputs": 4})
    with pytest.raises(ValueError, match="align"):
        pack([_ex([5, 1], labels=[1])], num_rows=1, lengths={"inputs": 4})

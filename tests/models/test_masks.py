"""Boolean masks (True = may attend) against hand-written numpy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_zoo.models import (
    AttentionMask,
    causal_mask,
    combine_masks,
    make_attention_mask,
    padding_mask,
    segment_mask,
)

pytestmark = pytest.mark.usefixtures("fast_compilation")


def test_padding_mask_matches_outer_product_of_non_pad():
    q = np.array([[5, 6, 0], [0, 7, 8]])
    kv = np.array([[1, 0, 4, 0], [9, 9, 9, 0]])
    got = np.asarray(padding_mask(jnp.asarray(q), jnp.asarray(kv)))
    want = (q != 0)[:, None, :, None] & (kv != 0)[:, None, None, :]
    assert got.shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(padding_mask(jnp.asarray(q))),
                                  (q != 0)[:, None, :, None] & (q != 0)[:, None, None, :])


def test_causal_mask_is_lower_triangular():
    got = np.asarray(causal_mask(4))
    assert got.shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(got[0, 0], np.tril(np.ones((4, 4), bool)))
    rect = np.asarray(causal_mask(2, 5))[0, 0]
    np.testing.assert_array_equal(rect, np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], bool))


def test_segment_mask_blocks_other_segments_and_padding():
    seg = np.array([[1, 1, 2, 2, 0]])
    got = np.asarray(segment_mask(jnp.asarray(seg)))[0, 0]
    want = (seg[0][:, None] == seg[0][None, :]) & (seg[0][:, None] != 0) & (seg[0][None, :] != 0)
    np.testing.assert_array_equal(got, want)
    assert not got[4].any() and not got[:, 4].any()


def test_combine_masks_is_logical_and_and_ignores_none():
    a = jnp.asarray(np.array([[[[1, 0], [1, 1]]]], bool))
    b = jnp.asarray(np.array([[[[1, 1], [0, 1]]]], bool))
    np.testing.assert_array_equal(np.asarray(combine_masks(a, None, b)),
                                  np.asarray(a) & np.asarray(b))
    assert combine_masks(None, None) is None


def test_attention_mask_dense_equals_combined_dense_masks():
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0]])
    mask = AttentionMask(q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                         kv_segment_ids=seg, causal=True)
    p = np.asarray(pos)[0]
    s = np.asarray(seg)[0]
    want = (s[:, None] == s[None]) & (s[:, None] != 0) & (s[None] != 0) & (p[None] <= p[:, None])
    np.testing.assert_array_equal(np.asarray(mask.dense_mask())[0, 0], want)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_mask_window(causal):
    pos = jnp.arange(8)[None]
    got = np.asarray(AttentionMask(q_positions=pos, kv_positions=pos, causal=causal,
                                   window=4).dense_mask())[0, 0]
    d = np.arange(8)[:, None] - np.arange(8)[None]
    want = ((d >= 0) & (d < 4)) if causal else (np.abs(d) <= 2)
    np.testing.assert_array_equal(got, want)


def test_make_attention_mask_defaults_and_error():
    m = make_attention_mask(jnp.array([[1, 1, 0]]), causal=True)
    np.testing.assert_array_equal(np.asarray(m.q_positions), [[0, 1, 2]])
    want = np.tril(np.ones((3, 3), bool))
    want[2, :] = want[:, 2] = False
    np.testing.assert_array_equal(np.asarray(m.dense_mask())[0, 0], want)
    cross = make_attention_mask(None, q_len=2, kv_len=5)
    assert cross.dense_mask().shape == (1, 1, 2, 5)
    with pytest.raises(ValueError, match="q_positions, q_segment_ids or q_len"):
        make_attention_mask(None)


def _blocks_equal_dense(mask, q_slice, kv_slice):
    block = np.asarray(mask.block(q_slice, kv_slice))
    dense = np.broadcast_to(np.asarray(mask.dense_mask()), (1, 1, 8, 8))
    np.testing.assert_array_equal(block, dense[:, :, q_slice, kv_slice])


def test_block_equals_slice_of_dense_with_full_inputs():
    pos = jnp.arange(8)[None]
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    mask = AttentionMask(q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                         kv_segment_ids=seg, causal=True, window=3)
    _blocks_equal_dense(mask, slice(4, 8), slice(0, 4))


def test_block_with_one_sided_segment_ids():
    pos = jnp.arange(8)[None]
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    mask = AttentionMask(q_positions=pos, kv_positions=pos, kv_segment_ids=seg)
    _blocks_equal_dense(mask, slice(4, 8), slice(0, 8))


def test_block_with_broadcast_dense_mask():
    pos = jnp.arange(8)[None]
    key_valid = jnp.array([[1, 1, 1, 1, 1, 1, 0, 0]], bool)[:, None, None, :]
    mask = AttentionMask(q_positions=pos, kv_positions=pos, dense=key_valid, causal=True)
    _blocks_equal_dense(mask, slice(4, 8), slice(0, 8))

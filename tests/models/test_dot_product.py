"""Scaled dot-product attention against the explainer, float64 numpy and jax.nn."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import key, normal

from transformer_zoo.models import AttentionMask, alibi_slopes, causal_mask, dot_product_attention
from transformer_zoo.models.dot_product import attention_dropout, attention_scores

pytestmark = pytest.mark.usefixtures("fast_compilation")


def reference_attention(q, k, v, mask=None, bias=None, scale=None):
    """Float64 numpy softmax(q k^T * scale + bias, masked) v with GQA head sharing.

    A query with no visible key gets zero weights (and a zero output).
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if mask is not None:
        s = np.where(np.asarray(mask), s, -np.inf)
    row_max = s.max(-1, keepdims=True)
    w = np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0))
    total = w.sum(-1, keepdims=True)
    w = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
    return np.einsum("bnts,bsnh->btnh", w, v), w


def qkv(seed, B=2, T=5, S=6, N=4, K=4, H=8, Hv=None):
    return (normal(seed, (B, T, N, H)), normal(seed + 1000, (B, S, K, H)),
            normal(seed + 2000, (B, S, K, Hv or H)))


def test_explainer_worked_example():
    q = jnp.array([2.0]).reshape(1, 1, 1, 1)
    k = jnp.array([2.0, 1.0]).reshape(1, 2, 1, 1)
    v = jnp.array([10.0, 4.0]).reshape(1, 2, 1, 1)
    out, weights = dot_product_attention(q, k, v, return_weights=True)
    np.testing.assert_allclose(np.asarray(weights).ravel(), [0.881, 0.119], atol=5e-4)
    # 9.2848: the explainer's 9.29 comes from the rounded weights.
    np.testing.assert_allclose(float(out.ravel()[0]), 9.29, atol=1e-2)
    # Exact: e^4 / (e^4 + e^2) and the matching convex combination of 10 and 4.
    w0 = np.exp(4.0) / (np.exp(4.0) + np.exp(2.0))
    np.testing.assert_allclose(float(out.ravel()[0]), 10 * w0 + 4 * (1 - w0), rtol=1e-6)


def test_matches_float64_reference_and_rows_sum_to_one():
    q, k, v = qkv(0, Hv=3)
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 5, 6)) < 0.7).at[..., 0].set(True)
    out, weights = dot_product_attention(q, k, v, mask=mask, return_weights=True)
    want, want_w = reference_attention(q, k, v, mask=mask)
    chex.assert_shape(out, (2, 5, 4, 3))
    chex.assert_shape(weights, (2, 4, 5, 6))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.asarray(weights)[np.broadcast_to(~np.asarray(mask), weights.shape)] == 0)


def test_causal_outputs_ignore_later_keys_and_values():
    q, k, v = qkv(9, T=6, S=6)
    mask = causal_mask(6)
    out = np.asarray(dot_product_attention(q, k, v, mask=mask))
    t = 2
    k2 = k.at[:, t + 1 :].set(normal(10, (2, 3, 4, 8)))
    v2 = v.at[:, t + 1 :].set(normal(11, (2, 3, 4, 8)))
    out2 = np.asarray(dot_product_attention(q, k2, v2, mask=mask))
    np.testing.assert_array_equal(out2[:, : t + 1], out[:, : t + 1])
    assert not np.allclose(out2[:, t + 1 :], out[:, t + 1 :], atol=1e-3)


def test_default_scale_is_one_over_sqrt_head_dim():
    q, k, v = qkv(1, H=16)
    out = dot_product_attention(q, k, v)
    np.testing.assert_allclose(out, dot_product_attention(q, k, v, scale=0.25), rtol=1e-6)
    np.testing.assert_allclose(out, reference_attention(q, k, v, scale=0.25)[0], rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(out, dot_product_attention(q, k, v, scale=1.0), atol=1e-3)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_parity_with_jax_nn_dot_product_attention(num_kv_heads):
    q, k, v = qkv(2, K=num_kv_heads)
    rng = np.random.default_rng(1)
    mask = jnp.asarray(rng.random((2, 4, 5, 6)) < 0.6).at[..., 2].set(True)
    bias = jnp.asarray(rng.normal(size=(1, 4, 5, 6)), jnp.float32)
    got = dot_product_attention(q, k, v, mask=mask, bias=bias)
    want = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if num_kv_heads != 4:
        return
    causal = dot_product_attention(q, k[:, :5], v[:, :5],
                                   mask=jnp.tril(jnp.ones((5, 5), bool))[None, None])
    np.testing.assert_allclose(
        causal, jax.nn.dot_product_attention(q, k[:, :5], v[:, :5], is_causal=True),
        rtol=1e-5, atol=1e-6)


def test_alibi_slopes_equal_explicit_distance_bias():
    q, k, v = qkv(3, T=6, S=6)
    slopes = jnp.asarray(alibi_slopes(4))
    pos = np.arange(6)
    bias = -np.asarray(slopes)[None, :, None, None] * np.abs(pos[:, None] - pos[None])
    got = dot_product_attention(q, k, v, alibi_slopes=slopes)
    want = jax.nn.dot_product_attention(q, k, v, bias=jnp.asarray(bias, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_mask_object_equals_its_dense_mask():
    q, k, v = qkv(4, T=6, S=6)
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    m = AttentionMask(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                      causal=True)
    got = dot_product_attention(q, k, v, mask=m, alibi_slopes=jnp.asarray(alibi_slopes(4)))
    bias = -np.asarray(alibi_slopes(4))[None, :, None, None] * np.abs(
        np.asarray(pos)[:, None, :, None] - np.asarray(pos)[:, None, None, :])
    want, _ = reference_attention(q, k, v, mask=m.dense_mask(), bias=bias)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[0, 5], 0.0)  # the padding query


def test_fully_masked_rows_are_zero_and_have_finite_gradients():
    q, k, v = qkv(5)
    mask = np.ones((2, 1, 5, 6), bool)
    mask[0, 0, 1] = False  # query 1 of batch 0 sees nothing
    mask = jnp.asarray(mask)

    @jax.jit
    def grads(q, k, v, mask):
        return jax.grad(lambda *a: jnp.sum(dot_product_attention(*a, mask=mask) ** 2),
                        argnums=(0, 1, 2))(q, k, v)

    out = dot_product_attention(q, k, v, mask=mask)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(np.asarray(out)[0, 1], 0.0)
    g = grads(q, k, v, mask)
    for x in g:
        assert np.all(np.isfinite(x))
    np.testing.assert_array_equal(np.asarray(g[0])[0, 1], 0.0)
    # Nothing visible at all: still finite, and no gradient flows.
    for x in grads(q, k, v, jnp.zeros((2, 1, 5, 6), bool)):
        assert np.all(np.isfinite(x))
        np.testing.assert_array_equal(np.asarray(x), 0.0)


@pytest.mark.parametrize("sigma", [1.0, 0.5])
def test_scaling_keeps_score_variance_at_sigma_to_the_fourth(sigma):
    """q.k of N(0, s^2) vectors has variance d_k s^4; dividing by sqrt(d_k) removes d_k."""
    n = 96  # 96 x 96 scores per d_k; products with distinct keys are uncorrelated.
    for i, d_k in enumerate((16, 256, 4096)):
        q = normal(100 + i, (1, n, 1, d_k), sigma)
        k = normal(200 + i, (1, n, 1, d_k), sigma)
        scaled = np.asarray(attention_scores(q, k, 1.0 / np.sqrt(d_k)), np.float64)
        unscaled = np.asarray(attention_scores(q, k, 1.0), np.float64)
        np.testing.assert_allclose(scaled.var(), sigma**4, rtol=0.15)
        np.testing.assert_allclose(unscaled.var() / (d_k * sigma**4), 1.0, rtol=0.15)


def test_dropout_on_weights():
    w = jnp.ones((200_000,))
    dropped = np.asarray(attention_dropout(w, 0.25, key(0)))
    assert set(np.unique(dropped)) <= {0.0, np.float32(1 / 0.75)}
    np.testing.assert_allclose(dropped.mean(), 1.0, atol=0.01)
    np.testing.assert_allclose((dropped == 0).mean(), 0.25, atol=0.01)
    q, k, v = qkv(6)
    det = dot_product_attention(q, k, v, dropout_rate=0.5, deterministic=True)
    np.testing.assert_allclose(det, dot_product_attention(q, k, v), rtol=1e-6)
    drop = dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key(1),
                                 deterministic=False)
    assert not np.allclose(drop, det, atol=1e-3)
    with pytest.raises(ValueError, match="dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.5, deterministic=False)


def test_low_precision_inputs_keep_float32_weights():
    q, k, v = (a.astype(jnp.bfloat16) for a in qkv(7))
    out, weights = dot_product_attention(q, k, v, return_weights=True)
    assert out.dtype == jnp.bfloat16 and weights.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), reference_attention(q, k, v)[0],
                               atol=5e-2)


def test_bad_inputs_raise_value_errors():
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 5, 7\).*\(2, 4, 5, 6\)"):
        dot_product_attention(q, k, v, mask=jnp.ones((2, 1, 5, 7), bool))
    with pytest.raises(ValueError, match="mask of shape"):
        dot_product_attention(q, k, v, mask=jnp.ones((5, 6), bool))
    with pytest.raises(ValueError, match="bias of shape"):
        dot_product_attention(q, k, v, bias=jnp.ones((2, 3, 5, 6)))
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        dot_product_attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="attention_impl='nope' is unknown"):
        dot_product_attention(q, k, v, impl="nope")
    with pytest.raises(ValueError, match="alibi_slopes"):
        dot_product_attention(q, k, v, alibi_slopes=jnp.ones((3,)))
    with pytest.raises(ValueError, match="expects query"):
        dot_product_attention(q[0], k, v)

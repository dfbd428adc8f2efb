"""Sliding-window (local) and kernelised linear attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_zoo.models import linear_attention, local_attention  # noqa: F401  (register the impls)
from transformer_zoo.models.dot_product import dot_product_attention
from transformer_zoo.models.masks import make_attention_mask


def _qkv(B, T, N, K, H, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, T, K, H)),
            jax.random.normal(ks[2], (B, T, K, H)))


def _packed(B, T):
    """[B, T] segment ids: row 0 packs two sequences then pads, others one sequence."""
    a, b = T // 2, T - T // 5
    row0 = [1] * a + [2] * (b - a) + [0] * (T - b)
    return jnp.asarray([row0] + [[1] * T] * (B - 1), jnp.int32)


def _value_and_grads(impl, q, k, v, mask, slopes=None):
    def loss(q, k, v):
        out = dot_product_attention(q, k, v, mask=mask, alibi_slopes=slopes, impl=impl)
        return jnp.sum(out * jnp.sin(out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return [out, *grads]


# --- local -------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_local_with_window_covering_sequence_equals_full_attention(causal):
    B, T, N, K, H = 2, 29, 4, 2, 8
    q, k, v = _qkv(B, T, N, K, H)
    seg = _packed(B, T)
    windowed = make_attention_mask(seg, causal=causal, window=2 * T + 1)
    full = make_attention_mask(seg, causal=causal)
    got = _value_and_grads("local", q, k, v, windowed)
    ref = _value_and_grads("xla", q, k, v, full)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("causal,window", [(True, 1), (True, 4), (True, 7), (False, 2),
                                           (False, 5), (False, 12)])
def test_local_equals_xla_with_dense_windowed_mask(causal, window):
    B, T, N, K, H = 2, 37, 4, 2, 8
    q, k, v = _qkv(B, T, N, K, H, seed=window)
    mask = make_attention_mask(_packed(B, T), causal=causal, window=window)
    slopes = jnp.linspace(0.1, 0.6, N)
    got = _value_and_grads("local", q, k, v, mask, slopes)
    ref = _value_and_grads("xla", q, k, v, mask.dense_mask(), slopes)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


def test_local_memory_is_linear_in_length():
    # Scores live in [B * nb, N, b, L] strips: doubling T doubles the biggest array.
    def biggest(T):
        q, k, v = _qkv(1, T, 2, 2, 8)
        mask = make_attention_mask(None, q_len=T, causal=True, window=16)
        jaxpr = jax.make_jaxpr(lambda q, k, v: dot_product_attention(
            q, k, v, mask=mask, impl="local"))(q, k, v)
        return max(int(np.prod(e.aval.shape)) for e in jaxpr.jaxpr.eqns for e in e.outvars)

    assert biggest(1024) == 2 * biggest(512)
    assert biggest(1024) < 1024 * 1024 // 8


def test_local_needs_a_window():
    q, k, v = _qkv(1, 8, 2, 2, 4)
    with pytest.raises(ValueError, match="window"):
        dot_product_attention(q, k, v, mask=make_attention_mask(None, q_len=8), impl="local")


# --- linear ------------------------------------------------------------------


def _phi64(x):
    x = np.asarray(x, np.float64)
    return np.where(x > 0, x + 1.0, np.exp(x))


def _linear_reference(q, k, v, mask):
    """The quadratic form: A = phi(q) phi(k)^T (masked), out = A v / rowsum(A)."""
    N, K = q.shape[2], k.shape[2]
    fk = np.repeat(_phi64(k), N // K, axis=2)
    vv = np.repeat(np.asarray(v, np.float64), N // K, axis=2)
    a = np.einsum("btnh,bsnh->bnts", _phi64(q), fk)
    if mask is not None:
        a = a * np.asarray(mask.dense_mask(), np.float64)
    num = np.einsum("bnts,bsnh->btnh", a, vv)
    den = a.sum(-1).transpose(0, 2, 1)[..., None]
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def _linear_masks(B, T):
    seg = _packed(B, T)
    pad = jnp.asarray(np.arange(T)[None] < np.array([[T - 6]] * B), jnp.int32)
    return {
        "none": None,
        "causal": make_attention_mask(None, q_len=T, causal=True),
        "kv_padding": make_attention_mask(None, pad, q_len=T),
        "packed_causal": make_attention_mask(seg, causal=True),
        "packed": make_attention_mask(seg),
    }


@pytest.mark.parametrize("kind", ["none", "causal", "kv_padding", "packed_causal", "packed"])
@pytest.mark.parametrize("chunk", [5, 16])
def test_linear_equals_quadratic_form(kind, chunk):
    B, T, N, K, H = 2, 37, 4, 2, 8
    q, k, v = _qkv(B, T, N, K, H, seed=chunk)
    mask = _linear_masks(B, T)[kind]
    got = linear_attention.linear_attention(q, k, v, mask=mask, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got, np.float64), _linear_reference(q, k, v, mask),
                               rtol=1e-5, atol=1e-6)


def test_linear_gradients_match_quadratic_form_in_jax():
    B, T, N, K, H = 1, 23, 2, 1, 8
    q, k, v = _qkv(B, T, N, K, H)
    mask = make_attention_mask(_packed(B, T), causal=True)

    def quadratic(q, k, v):
        fq, fk = linear_attention.feature_map(q), linear_attention.feature_map(k)
        a = jnp.einsum("btnh,bsnh->bnts", fq, jnp.repeat(fk, N // K, 2)) * mask.dense_mask()
        num = jnp.einsum("bnts,bsnh->btnh", a, jnp.repeat(v, N // K, 2))
        den = a.sum(-1).transpose(0, 2, 1)[..., None]
        return num / jnp.where(den > 0, den, 1.0)  # padding rows: 0, not 0/0

    def linear(q, k, v):
        return linear_attention.linear_attention(q, k, v, mask=mask, chunk=4)

    ga = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(linear(*a))), (0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(quadratic(*a))), (0, 1, 2)))(q, k, v)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_causal_linear_does_not_look_ahead():
    B, T, N, K, H, t = 1, 40, 2, 2, 8, 17
    q, k, v = _qkv(B, T, N, K, H)
    mask = make_attention_mask(None, q_len=T, causal=True)
    out = dot_product_attention(q, k, v, mask=mask, impl="linear")
    noise = jax.random.normal(jax.random.PRNGKey(9), (3, B, T - t - 1, K, H))
    q2 = q.at[:, t + 1 :].add(jnp.repeat(noise[0], N // K, axis=2))
    k2, v2 = k.at[:, t + 1 :].add(noise[1]), v.at[:, t + 1 :].add(noise[2])
    out2 = dot_product_attention(q2, k2, v2, mask=mask, impl="linear")
    np.testing.assert_allclose(out2[:, : t + 1], out[:, : t + 1], rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(out2[:, t + 1 :] - out[:, t + 1 :]))) > 1e-3


@pytest.mark.parametrize("bad", ["alibi", "window", "dense", "dropout"])
def test_linear_refuses_what_it_cannot_honour(bad):
    q, k, v = _qkv(1, 8, 2, 2, 4)
    kwargs = {"mask": make_attention_mask(None, q_len=8)}
    if bad == "alibi":
        kwargs["alibi_slopes"] = jnp.ones(2)
    elif bad == "window":
        kwargs["mask"] = make_attention_mask(None, q_len=8, window=2)
    elif bad == "dense":
        kwargs["mask"] = jnp.ones((1, 1, 8, 8), bool)
    else:
        kwargs.update(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0), deterministic=False)
    with pytest.raises(ValueError, match="linear"):
        dot_product_attention(q, k, v, impl="linear", **kwargs)

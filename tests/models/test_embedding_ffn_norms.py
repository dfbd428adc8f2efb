"""Embed (sqrt(D) scale, tied logits), the FFN variants and the norms vs float64 numpy."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import expit
from zoo_testlib import init, key, normal

from transformer_zoo.models import Embed, FeedForward, LayerNorm, RMSNorm
from transformer_zoo.models.norms import make_norm

pytestmark = pytest.mark.usefixtures("fast_compilation")

D = 16


def test_embed_is_table_lookup_times_sqrt_d_exactly():
    embed = Embed(num_embeddings=32, features=D)
    ids = jnp.array([[3, 0, 31, 3], [7, 8, 9, 10]])
    params = init(embed, ids)
    table = np.asarray(params["embedding"])
    assert table.shape == (32, D)
    got = np.asarray(embed.apply({"params": params}, ids))
    np.testing.assert_array_equal(got, table[np.asarray(ids)] * np.float32(np.sqrt(D)))
    unscaled = Embed(num_embeddings=32, features=D, scale_by_sqrt_dim=False)
    np.testing.assert_array_equal(np.asarray(unscaled.apply({"params": params}, ids)),
                                  table[np.asarray(ids)])


def test_tied_logits_are_x_times_table_transposed():
    embed = Embed(num_embeddings=32, features=D)
    params = init(embed, jnp.zeros((1, 1), jnp.int32))
    x = normal(0, (2, 3, D))
    logits = embed.apply({"params": params}, x, method=Embed.attend)
    assert logits.shape == (2, 3, 32) and logits.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(params["embedding"], np.float64).T
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_embed_rejects_float_ids():
    embed = Embed(num_embeddings=32, features=D)
    with pytest.raises(TypeError, match="integer token ids, got dtype float32"):
        embed.init(key(0), jnp.zeros((1, 2), jnp.float32))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


REFERENCE_ACTIVATIONS = {
    "relu": (lambda x: np.maximum(x, 0.0), False),
    "gelu": (_gelu_tanh, False),  # flax's nn.gelu: the tanh approximation
    "swiglu": (lambda x: x * expit(x), True),
    "geglu": (_gelu_tanh, True),
}


@pytest.mark.parametrize("activation", sorted(REFERENCE_ACTIVATIONS))
def test_ffn_matches_float64_reference(activation):
    ffn = FeedForward(d_ff=32, activation=activation)
    x = normal(1, (2, 3, D))
    params = init(ffn, x)
    act, gated = REFERENCE_ACTIVATIONS[activation]
    expected_layers = {"wi", "wo"} | ({"wi_gate"} if gated else set())
    assert set(params) == expected_layers
    assert params["wi"]["kernel"].shape == (D, 32) and params["wo"]["kernel"].shape == (32, D)
    p = {k: {n: np.asarray(v, np.float64) for n, v in layer.items()} for k, layer in params.items()}
    x64 = np.asarray(x, np.float64)
    h = act(x64 @ p["wi"]["kernel"] + p["wi"]["bias"])
    if gated:
        h = h * (x64 @ p["wi_gate"]["kernel"] + p["wi_gate"]["bias"])
    want = h @ p["wo"]["kernel"] + p["wo"]["bias"]
    np.testing.assert_allclose(ffn.apply({"params": params}, x), want, rtol=1e-5, atol=1e-5)


def _with_affine(params, seed):
    """Non-trivial gamma/beta so that the affine part is tested too."""
    return {k: normal(seed + i, v.shape) for i, (k, v) in enumerate(sorted(params.items()))}


def test_layernorm_matches_float64_reference_and_flax():
    x = normal(2, (2, 3, D), 3.0) + 1.5
    ln = LayerNorm(epsilon=1e-6)
    params = _with_affine(init(ln, x), 10)
    x64 = np.asarray(x, np.float64)
    mean = x64.mean(-1, keepdims=True)
    var = x64.var(-1, keepdims=True)
    want = (x64 - mean) / np.sqrt(var + 1e-6) * np.asarray(params["scale"]) + np.asarray(
        params["bias"])
    got = ln.apply({"params": params}, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    flax_out = nn.LayerNorm(epsilon=1e-6).apply({"params": params}, x)
    np.testing.assert_allclose(got, flax_out, rtol=1e-5, atol=1e-5)


def test_rmsnorm_matches_float64_reference():
    x = normal(3, (2, 3, D), 2.0) + 0.5
    rms = RMSNorm(epsilon=1e-6)
    params = _with_affine(init(rms, x), 20)
    assert set(params) == {"scale"}
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(params["scale"])
    np.testing.assert_allclose(rms.apply({"params": params}, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norms_compute_in_float32_and_return_compute_dtype(kind):
    x = (normal(4, (2, 3, D), 100.0) + 1000.0).astype(jnp.bfloat16)
    norm = make_norm(kind, 1e-6, jnp.bfloat16, jnp.float32)
    params = init(norm, x)
    out = norm.apply({"params": params}, x)
    assert out.dtype == jnp.bfloat16 and params["scale"].dtype == jnp.float32
    ref = make_norm(kind, 1e-6, jnp.float32, jnp.float32).apply(
        {"params": params}, x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)


def test_unknown_norm():
    with pytest.raises(ValueError, match="norm='batchnorm' is unknown"):
        make_norm("batchnorm", 1e-6, jnp.float32, jnp.float32)

"""Streamed decoding products (models/streamed.py): the product itself against
float64, the decode-weight copies (made only by generate's cache-creating call,
never by init), and streamed decoding against the plain dot path."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import init, key, normal, tiny_config

import models
from models import FeedForward, MultiHeadAttention, streamed
from models import generate as gen
from models.projection import Projection

DW = streamed.DECODE_WEIGHTS

pytestmark = pytest.mark.usefixtures("fast_compilation")


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_streamed_matmul_matches_float64(rows):
    x, w_t = normal(0, (rows, 48)), normal(1, (40, 48))
    expected = np.asarray(x, np.float64) @ np.asarray(w_t, np.float64).T
    np.testing.assert_allclose(streamed.streamed_matmul(x, w_t), expected, rtol=1e-5, atol=1e-5)


def test_streamed_matmul_accumulates_bfloat16_in_float32():
    x, w_t = normal(0, (8, 256)).astype(jnp.bfloat16), normal(1, (16, 256)).astype(jnp.bfloat16)
    out = streamed.streamed_matmul(x, w_t)
    assert out.dtype == jnp.float32
    expected = np.asarray(x, np.float64) @ np.asarray(w_t, np.float64).T  # exact bf16 values
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_streamed_matmul_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \(8, 16\) and w_t \(4, 12\)"):
        streamed.streamed_matmul(jnp.ones((8, 16)), jnp.ones((4, 12)))


def _apply_with_decode_weights(module, params, *args):
    """The cache-creating call's way: the decode-weights collection mutable."""
    out, created = module.apply({"params": params}, *args, mutable=[DW])
    return out, created[DW]


@pytest.mark.parametrize("features,in_dims", [(24, 1), ((3, 8), 1), (16, 2)])
def test_projection_streamed_equals_dot(features, in_dims):
    proj = Projection(features, ("a",) * (in_dims + (1 if isinstance(features, int) else 2)),
                      in_dims=in_dims, use_bias=True)
    x = normal(0, (2, 3, 4, 4) if in_dims == 2 else (2, 3, 16))
    params = init(proj, x)
    params = {**params, "bias": normal(5, params["bias"].shape)}
    plain = proj.apply({"params": params}, x)
    big = normal(1, (40,) + x.shape[2:]) if in_dims == 2 else normal(1, (40, 16))
    _, weights = _apply_with_decode_weights(proj, params, big)  # 40 rows: created, dot used
    fan_in = int(np.prod(x.shape[-in_dims:]))
    np.testing.assert_array_equal(weights["kernel_t"], params["kernel"].reshape(fan_in, -1).T)
    streamed_out = proj.apply({"params": params, DW: weights}, x)  # 6 rows: streamed
    np.testing.assert_allclose(streamed_out, plain, rtol=1e-5, atol=1e-6)


def test_init_never_creates_decode_weights():
    """init makes every collection mutable; a stored copy would go stale in training."""
    ids = jnp.ones((2, 6), jnp.int32)
    encdec = models.EncoderDecoder(tiny_config())
    assert set(jax.eval_shape(encdec.init, key(), ids, ids)) == {"params"}
    variables = jax.eval_shape(lambda: models.DecoderOnly(tiny_config()).init(key(), ids,
                                                                              decode=True))
    assert set(variables) == {"params", "cache"}


@pytest.mark.parametrize("use_bias,num_kv_heads", [(False, None), (True, 2)])
def test_self_attention_streams_one_fused_qkv(use_bias, num_kv_heads):
    """Q, K and V share one transposed copy [(N + 2K) H, D]; alone each would share
    x's broadcast with the others, which XLA stores. Equal to the dot path."""
    mha = MultiHeadAttention(num_heads=4, num_kv_heads=num_kv_heads, use_bias=use_bias)
    x = normal(0, (2, 3, 16))
    params = init(mha, x)
    if use_bias:
        params = jax.tree.map(lambda p: p + 0.1 * normal(3, p.shape) if p.ndim <= 2 else p, params)
    plain = mha.apply({"params": params}, x)
    _, weights = _apply_with_decode_weights(mha, params, normal(1, (4, 10, 16)))
    kv = num_kv_heads or 4
    assert weights["qkv_t"].shape == ((4 + 2 * kv) * 4, 16)
    assert set(weights) == {"qkv_t", "out"}  # no per-projection copies of Q, K, V
    streamed_out = mha.apply({"params": params, DW: weights}, x)
    np.testing.assert_allclose(streamed_out, plain, rtol=1e-5, atol=1e-6)


def test_ffn_keeps_nn_dense_parameters_and_gated_wi_is_not_streamed():
    """Same names, shapes and initial values as nn.Dense (checkpoints unchanged)."""

    class DenseFFN(nn.Module):  # the FFN as it was written with nn.Dense
        @nn.compact
        def __call__(self, x):
            init_k = nn.initializers.xavier_uniform()
            h = nn.relu(nn.Dense(32, kernel_init=init_k, name="wi")(x))
            return nn.Dense(16, kernel_init=init_k, name="wo")(h)

    x = normal(0, (2, 3, 16))
    ours, ref = init(FeedForward(d_ff=32), x), init(DenseFFN(), x)
    jax.tree.map(np.testing.assert_array_equal, ours, ref)
    gated = FeedForward(d_ff=32, activation="swiglu")
    _, weights = _apply_with_decode_weights(gated, init(gated, x), normal(1, (40, 16)))
    assert set(weights) == {"wo"}


def test_translation_streamed_equals_unstreamed(monkeypatch):
    """Greedy tokens and beam scores with streamed steps equal the dot path's."""
    cfg = tiny_config(num_decoder_layers=2, tie_output=True, norm_position="pre")
    model = models.EncoderDecoder(cfg)
    src = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    params = init(model, src, src)
    kw = dict(max_extra=4, eos_id=-1)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(streamed, "enabled", lambda on=on: on)
        jax.clear_caches()  # the searches are jitted: retrace with the setting
        runs[on] = (gen.translate_greedy(model, params, src, **kw),
                    gen.translate_beams(model, params, src, beam_size=3, **kw))
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    np.testing.assert_array_equal(runs[True][1][0], runs[False][1][0])
    np.testing.assert_allclose(runs[True][1][1], runs[False][1][1], rtol=1e-5)


def test_generation_creates_decode_weights_only_on_cpu(monkeypatch):
    model = models.DecoderOnly(tiny_config())
    prompts = jnp.array([[5, 6, 0], [7, 8, 9]])
    params = jax.eval_shape(lambda: init(model, prompts))
    for on in (True, False):
        monkeypatch.setattr(streamed, "enabled", lambda on=on: on)
        assert (DW in gen._created_collections()) == on
        state = jax.eval_shape(lambda p: gen.prepare_generation(model, p, prompts, 3)[1], params)
        assert DW not in state  # beam search reorders the state; the weights stay outside

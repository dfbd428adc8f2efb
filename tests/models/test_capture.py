"""Attention capture: shapes per family, rows are distributions over the visible keys,
the weights equal return_weights=True and the reference on the projected q/k, outputs
are unchanged, and implementations that return no weights are captured too."""

import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import assert_close, init, normal, random_ids, tiny_config

from transformer_zoo.models import (
    AttentionMask,
    DecoderOnly,
    EncoderDecoder,
    EncoderOnly,
    MultiHeadAttention,
    capture_attention,
    dot_product_attention,
)
from transformer_zoo.models import attention as attention_module

pytestmark = pytest.mark.usefixtures("fast_compilation")

B, S, T = 2, 7, 5
SOURCE_LENGTHS, TARGET_LENGTHS = (7, 4), (3, 5)  # row 0 of the source has no padding


def _padded(seed, shape, lengths):
    ids = np.array(random_ids(seed, shape))
    for row, n in enumerate(lengths):
        ids[row, n:] = 0  # PAD
    return jnp.asarray(ids)


SOURCE = _padded(0, (B, S), SOURCE_LENGTHS)
TARGET = _padded(1, (B, T), TARGET_LENGTHS)


@functools.cache
def _family(name, **overrides):
    """(model, params, inputs) of one family with 2 decoder layers and padded inputs."""
    cfg = tiny_config(num_decoder_layers=2, **overrides)
    if name == "encoder_decoder":
        model, args = EncoderDecoder(cfg), (SOURCE, TARGET)
    elif name == "decoder_only":
        model, args = DecoderOnly(cfg), (TARGET,)
    else:
        model, args = EncoderOnly(cfg), (SOURCE,)
    return model, init(model, *args), args


EXPECTED = {
    "encoder_decoder": {"encoder/layer_0/self_attention": (S, S, SOURCE_LENGTHS, SOURCE_LENGTHS),
                        "decoder/layer_0/self_attention": (T, T, TARGET_LENGTHS, TARGET_LENGTHS),
                        "decoder/layer_0/cross_attention": (T, S, TARGET_LENGTHS, SOURCE_LENGTHS),
                        "decoder/layer_1/self_attention": (T, T, TARGET_LENGTHS, TARGET_LENGTHS),
                        "decoder/layer_1/cross_attention": (T, S, TARGET_LENGTHS,
                                                            SOURCE_LENGTHS)},
    "decoder_only": {"decoder/layer_0/self_attention": (T, T, TARGET_LENGTHS, TARGET_LENGTHS),
                     "decoder/layer_1/self_attention": (T, T, TARGET_LENGTHS, TARGET_LENGTHS)},
    "encoder_only": {"encoder/layer_0/self_attention": (S, S, SOURCE_LENGTHS, SOURCE_LENGTHS)},
}
FAMILIES = tuple(EXPECTED)


def _visible(name, q_lengths, kv_lengths, q_len, kv_len):
    """[B, 1, T, S] bool: keys a query may see (padding, and causality in decoder self)."""
    q_ok = np.arange(q_len)[None, :] < np.asarray(q_lengths)[:, None]
    kv_ok = np.arange(kv_len)[None, :] < np.asarray(kv_lengths)[:, None]
    visible = q_ok[:, :, None] & kv_ok[:, None, :]
    if name.startswith("decoder") and name.endswith("self_attention"):
        visible &= np.tril(np.ones((q_len, kv_len), bool))[None]
    return visible[:, None]


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_rows_and_masked_entries(family):
    model, params, args = _family(family)
    weights, _ = capture_attention(model, params, *args)
    assert list(weights) == list(EXPECTED[family])  # encoder, decoder; self before cross
    for name, (q_len, kv_len, q_lengths, kv_lengths) in EXPECTED[family].items():
        w = np.asarray(weights[name])
        assert w.shape == (B, 4, q_len, kv_len) and w.dtype == np.float32, name
        visible = _visible(name, q_lengths, kv_lengths, q_len, kv_len)
        assert np.all(w[~np.broadcast_to(visible, w.shape)] == 0.0), name  # exactly 0
        q_ok = np.arange(q_len)[None, :] < np.asarray(q_lengths)[:, None]
        # Real queries: a distribution over their visible keys; padding queries: zeros.
        np.testing.assert_allclose(w.sum(-1), np.broadcast_to(q_ok[:, None], w.shape[:3]),
                                   atol=1e-6, err_msg=name)
        assert np.all(w >= 0.0), name


def _with_return_weights(model, params, args):
    """Every attention call rerun with return_weights=True on its own inputs: {path: w}."""
    found = {}

    def interceptor(next_fun, call_args, kwargs, context):
        if not isinstance(context.module, MultiHeadAttention) or context.method_name != "__call__":
            return next_fun(*call_args, **kwargs)
        out, w = next_fun(*call_args, **{**kwargs, "return_weights": True})
        found["/".join(context.module.scope.path)] = w
        return out

    with nn.intercept_methods(interceptor):
        out = model.apply({"params": params}, *args)
    return found, out


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_equal_return_weights_and_outputs_are_unchanged(family):
    model, params, args = _family(family)
    weights, captured_out = capture_attention(model, params, *args)
    direct, direct_out = _with_return_weights(model, params, args)
    assert sorted(direct) == sorted(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(w, direct[name], err_msg=name)
    plain = model.apply({"params": params}, *args)
    for a, b in zip(_leaves(captured_out), _leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(direct_out), _leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)


def _leaves(out):
    return [out[k] for k in sorted(out)] if isinstance(out, dict) else [out]


def test_weights_equal_the_reference_on_the_projected_queries_and_keys():
    x, memory = normal(0, (B, T, 16)), normal(1, (B, S, 16))
    mask = AttentionMask(q_positions=jnp.arange(T)[None], kv_positions=jnp.arange(T)[None],
                         causal=True)
    mha = MultiHeadAttention(num_heads=4, num_kv_heads=2, use_bias=True)
    params = init(mha, x)

    def project(name, inputs):
        p = params[name]
        return jnp.einsum("btd,dnh->btnh", inputs, p["kernel"]) + p["bias"]

    for kv, kw in ((None, {"mask": mask}), (memory, {})):
        weights, _ = capture_attention(mha, params, x, kv, **kw)
        source = x if kv is None else kv
        _, want = dot_product_attention(project("query", x), project("key", source),
                                        project("value", source), return_weights=True,
                                        mask=kw.get("mask"))
        assert list(weights) == [""]
        assert_close(weights[""], want, atol=1e-6)


def _counting(monkeypatch):
    """Records (impl, return_weights) of every dot_product_attention call of attention.py."""
    calls = []
    real = attention_module.dot_product_attention

    def counted(*args, **kwargs):
        calls.append((str(kwargs.get("impl")), kwargs.get("return_weights")))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "dot_product_attention", counted)
    return calls


def test_blockwise_is_captured_from_the_reference_and_computes_nothing_extra(monkeypatch):
    reference, params, args = _family("encoder_decoder")
    # The same parameters: attention_impl is not one.
    model = EncoderDecoder(tiny_config(num_decoder_layers=2, attention_impl="blockwise"))
    calls = _counting(monkeypatch)
    plain = model.apply({"params": params}, *args)
    assert calls == [("blockwise", False)] * 5  # uncaptured: no weights are computed
    calls.clear()
    weights, out = capture_attention(model, params, *args)
    assert calls.count(("blockwise", False)) == 5 and calls.count(("xla", True)) == 5
    np.testing.assert_array_equal(out, plain)  # the output is still blockwise's own
    want, _ = capture_attention(reference, params, *args)
    assert list(weights) == list(want)
    for name in weights:
        assert_close(weights[name], want[name], atol=1e-5)


@pytest.mark.parametrize("impl", ["blockwise", "local"])
def test_alibi_and_windows_are_captured_through_the_reference(impl):
    x = normal(3, (B, 9, 16))
    positions = jnp.arange(9)[None]
    mask = AttentionMask(q_positions=positions, kv_positions=positions, causal=True)
    kw = dict(num_heads=4, position_encoding="alibi", attention_window=3)
    mha = MultiHeadAttention(attention_impl=impl, **kw)
    params = init(MultiHeadAttention(**kw), x, mask=mask)
    weights, out = capture_attention(mha, params, x, mask=mask)
    np.testing.assert_array_equal(out, mha.apply({"params": params}, x, mask=mask))
    _, want = MultiHeadAttention(**kw).apply({"params": params}, x, mask=mask,
                                             return_weights=True)
    assert_close(weights[""], want, atol=1e-6)
    assert np.all(np.asarray(weights[""])[..., np.tril(np.ones((9, 9)), -3) > 0] == 0)  # window


def test_linear_attention_captures_its_own_kernel_weights():
    x = normal(2, (B, T, 16))
    segments = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    positions = jnp.arange(T)[None]
    mask = AttentionMask(q_positions=positions, kv_positions=positions, causal=True,
                         q_segment_ids=segments, kv_segment_ids=segments)
    mha = MultiHeadAttention(num_heads=4, attention_impl="linear")
    params = init(mha, x, mask=mask)
    weights, out = capture_attention(mha, params, x, mask=mask)
    w = np.asarray(weights[""])
    assert np.all(np.triu(np.ones((T, T), bool), 1)[None, None] <= (w == 0))  # causal
    np.testing.assert_allclose(w.sum(-1), np.broadcast_to((segments != 0)[:, None], w.shape[:3]),
                               atol=1e-6)
    # Linear attention's output is exactly these weights times the values.
    value = jnp.einsum("btd,dnh->btnh", x, params["value"]["kernel"])
    heads = jnp.einsum("bnts,bsnh->btnh", w, value).reshape(B, T, 16)
    assert_close(out, heads @ params["out"]["kernel"].reshape(16, 16), atol=1e-5)

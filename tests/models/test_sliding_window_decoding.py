"""Sliding-window attention while decoding: the KV-cache path applies
`attention_window` exactly as the full pass does, for the standalone module,
both generating families and every attention implementation decoding meets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import (
    assert_close,
    decoder_only_cached,
    encoder_decoder_cached,
    init,
    key,
    normal,
    random_ids,
    tiny_config,
)

from transformer_zoo import models
from transformer_zoo.models import MultiHeadAttention, make_attention_mask
from transformer_zoo.models import generate as gen

pytestmark = pytest.mark.usefixtures("fast_compilation")

WINDOW = 2


def _mha_cached(mha, params, x, prefill):
    """mha over x fed through its cache: `prefill` tokens, then one at a time."""
    _, init_vars = mha.apply({"params": params}, jnp.zeros_like(x), decode=True,
                             mutable=["cache"])
    cache, outs, t = init_vars["cache"], [], 0
    for end in [prefill, *range(prefill + 1, x.shape[1] + 1)] if prefill else range(
            1, x.shape[1] + 1):
        out, new = mha.apply({"params": params, "cache": cache}, x[:, t:end], decode=True,
                             mutable=["cache"])
        cache, t = new["cache"], end
        outs.append(out)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("kwargs", [dict(), dict(position_encoding="rope"),
                                    dict(position_encoding="alibi", num_kv_heads=2),
                                    dict(score_fn="additive")],
                         ids=["plain", "rope", "alibi-gqa", "additive"])
@pytest.mark.parametrize("prefill", [0, 3])
def test_self_attention_cached_equals_windowed_forward(kwargs, prefill):
    x = normal(7, (2, 7, 16))
    mha = MultiHeadAttention(num_heads=4, attention_window=WINDOW, **kwargs)
    params = init(mha, x)
    full = mha.apply({"params": params}, x, mask=make_attention_mask(None, q_len=7, causal=True))
    assert_close(_mha_cached(mha, params, x, prefill), full)
    # The window matters: without it the outputs differ.
    plain = MultiHeadAttention(num_heads=4, **kwargs)
    unwindowed = plain.apply({"params": params}, x,
                             mask=make_attention_mask(None, q_len=7, causal=True))
    assert float(jnp.abs(unwindowed - full).max()) > 1e-3


def test_the_module_window_agrees_with_the_mask_window():
    x = normal(1, (1, 6, 8))
    mha = MultiHeadAttention(num_heads=2, attention_window=WINDOW)
    params = init(mha, x)
    explicit = MultiHeadAttention(num_heads=2).apply(
        {"params": params}, x, mask=make_attention_mask(None, q_len=6, causal=True,
                                                        window=WINDOW))
    assert_close(mha.apply({"params": params}, x,
                           mask=make_attention_mask(None, q_len=6, causal=True)), explicit)
    with pytest.raises(ValueError, match="mask.window=3 disagrees"):
        mha.apply({"params": params}, x, mask=make_attention_mask(None, q_len=6, window=3))
    with pytest.raises(ValueError, match="needs an AttentionMask"):
        mha.apply({"params": params}, x, mask=jnp.ones((1, 1, 6, 6), bool))


@pytest.mark.parametrize("impl", ["xla", "local", "blockwise"])
@pytest.mark.parametrize("position_encoding", ["sinusoidal", "rope", "alibi"])
def test_decoder_only_cached_equals_forward_with_a_window(impl, position_encoding):
    cfg = tiny_config(attention_window=WINDOW, attention_impl=impl,
                      position_encoding=position_encoding, num_decoder_layers=2)
    model = models.DecoderOnly(cfg)
    targets = random_ids(0, (2, 7))
    params = init(model, targets)
    full = model.apply({"params": params}, targets)
    assert_close(decoder_only_cached(model, params, targets), full, 1e-5, 2e-5)
    assert_close(decoder_only_cached(model, params, targets, prefill=4), full, 1e-5, 2e-5)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_encoder_decoder_cached_equals_forward_with_a_window(impl):
    cfg = tiny_config(attention_window=WINDOW, attention_impl=impl, num_decoder_layers=2)
    model = models.EncoderDecoder(cfg)
    inputs, targets = random_ids(1, (2, 6)), random_ids(2, (2, 7))
    params = init(model, inputs, targets)
    full = model.apply({"params": params}, inputs, targets)
    assert_close(encoder_decoder_cached(model, params, inputs, targets), full, 1e-5, 2e-5)


def test_generate_cached_equals_recomputed_with_a_window_and_sampling():
    cfg = tiny_config(attention_window=WINDOW, num_decoder_layers=2, position_encoding="rope")
    model = models.DecoderOnly(cfg)
    prompts = jnp.array([[5, 6, 7, 0], [8, 9, 10, 11]])  # ragged: left-aligned in the cache
    params = init(model, prompts)
    params = jax.tree.map(lambda p: 3.0 * p, params)  # sharper logits: tokens depend on context
    kw = dict(max_new_tokens=8, eos_id=-1, temperature=0.8, top_k=5, rng=key(4))
    cached = gen.generate(model, params, prompts, **kw)
    recomputed = gen.generate(model, params, prompts, use_cache=False, **kw)
    np.testing.assert_array_equal(cached, recomputed)
    greedy = dict(max_new_tokens=8, eos_id=-1, greedy=True)
    np.testing.assert_array_equal(gen.generate(model, params, prompts, **greedy),
                                  gen.generate(model, params, prompts, use_cache=False, **greedy))

"""Small shared helpers for the models/ tests: tiny configs and cached decoding loops."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_zoo.models import DecoderOnly, EncoderDecoder, ModelConfig, shift_right

TINY = dict(
    vocab_size=32,
    d_model=16,
    num_heads=4,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_length=16,
)


def tiny_config(**overrides) -> ModelConfig:
    """A one-layer model, small enough to run eagerly on CPU."""
    return ModelConfig(**{**TINY, **overrides})


def key(seed: int = 0):
    """A PRNG key for init and dropout.

    The "rbg" generator compiles in a fraction of the time threefry needs for
    the multi-dimensional kernels on CPU; the tests only need some randomness.
    """
    return jax.random.key(seed, impl="rbg")


def init(model, *args, seed: int = 0, **kwargs):
    """`model.init` with an rbg key; returns the unboxed params."""
    return unbox(model.init(key(seed), *args, **kwargs)["params"])


def unbox(tree):
    """Strips the logical-partitioning boxes from a variable tree."""
    return nn.meta.unbox(tree)


def random_ids(seed: int, shape, vocab: int = 32, low: int = 3) -> jnp.ndarray:
    """Token ids in [low, vocab): no PAD (0) and no BOS (2)."""
    return jnp.asarray(np.random.default_rng(seed).integers(low, vocab, size=shape), jnp.int32)


def normal(seed: int, shape, scale: float = 1.0) -> jnp.ndarray:
    """Float32 N(0, scale^2) test data (numpy: no PRNG compilation)."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=atol)


def decoder_only_cached(model: DecoderOnly, params, targets, prefill: int = 0):
    """Logits of `targets` fed through the KV cache: `prefill` tokens at once, then one by one.

    The fed tokens are shift_right(targets), so the result is comparable to the
    teacher-forced forward `model.apply(params, targets)`.
    """
    tokens = shift_right(targets, model.config.bos_id)
    _, init = model.apply({"params": params}, jnp.zeros_like(tokens), decode=True,
                          mutable=["cache"])

    def step(cache, ids):
        logits, new = model.apply({"params": params, "cache": cache}, ids, decode=True,
                                  mutable=["cache"])
        return logits, new["cache"]

    return _run_steps(step, init["cache"], tokens, prefill)


def encoder_decoder_cached(model: EncoderDecoder, params, inputs, targets, prefill: int = 0,
                           poison_encoded: bool = False):
    """EncoderDecoder logits through `decode(..., decode=True)` with its cache.

    With `poison_encoded`, the steps after the cache-creating call receive a
    zero encoder output: the result only matches the forward if the
    cross-attention keys/values were cached.
    """
    cfg = model.config
    in_seg = (inputs != cfg.pad_id).astype(jnp.int32)
    encoded = model.apply({"params": params}, inputs, method=EncoderDecoder.encode)
    tokens = shift_right(targets, cfg.bos_id)
    _, init = model.apply({"params": params}, encoded, in_seg, jnp.zeros_like(tokens),
                          decode=True, method=EncoderDecoder.decode, mutable=["cache"])
    step_encoded = jnp.zeros_like(encoded) if poison_encoded else encoded

    def step(cache, ids):
        logits, new = model.apply({"params": params, "cache": cache}, step_encoded, in_seg, ids,
                                  decode=True, method=EncoderDecoder.decode, mutable=["cache"])
        return logits, new["cache"]

    return _run_steps(step, init["cache"], tokens, prefill)


def _run_steps(step, cache, tokens, prefill):
    outs = []
    t = 0
    if prefill:
        logits, cache = step(cache, tokens[:, :prefill])
        outs.append(logits)
        t = prefill
    for i in range(t, tokens.shape[1]):
        logits, cache = step(cache, tokens[:, i : i + 1])
        outs.append(logits)
    return jnp.concatenate(outs, axis=1)

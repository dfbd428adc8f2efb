"""Scaled dot-product attention and the registry of its implementations.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + bias, masked) V

Shapes follow jax.nn.dot_product_attention and flax.linen: query [B, T, N, H],
key [B, S, K, H], value [B, S, K, Hv]; N = K * G for grouped-query attention
(query head n uses key/value head n // G). Scores are [B, N, T, S].

Implementations register under a name (`register_attention_impl`) and are
chosen with `impl=`; `xla` here materialises the scores and is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from transformer_zoo.models.dropout import dropout
from transformer_zoo.models.masks import NEG_INF, AttentionMask

Array = Any

_IMPLS: dict[str, Callable[..., Array]] = {}


def register_attention_impl(name: str, fn: Callable[..., Array]) -> None:
    """Registers `fn(query, key, value, *, mask, bias, alibi_slopes, scale,
    dropout_rate, dropout_rng, deterministic, return_weights)` under `name`."""
    _IMPLS[name] = fn


def attention_impls() -> tuple[str, ...]:
    """Names of the registered implementations."""
    return tuple(sorted(_IMPLS))


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | AttentionMask | None = None,
    bias: Array | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    impl: str = "xla",
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention.

    Args:
      query: [B, T, N, H].
      key: [B, S, K, H] with N divisible by K.
      value: [B, S, K, Hv].
      mask: bool, True = may attend: an array broadcastable to [B, N, T, S] or
        an `AttentionMask`. A query whose keys are all masked outputs zeros.
      bias: additive float bias broadcastable to [B, N, T, S].
      alibi_slopes: [N] ALiBi slopes; adds -slope * |q_pos - k_pos| using the
        positions of `mask` (an AttentionMask) or 0..T-1 / 0..S-1.
      scale: score scale, default 1 / sqrt(H).
      dropout_rate: dropout on the attention weights (when not deterministic).
      dropout_rng: PRNG key for that dropout.
      deterministic: disables dropout.
      return_weights: also return the [B, N, T, S] float32 weights (xla only).
      impl: a registered implementation name (see `attention_impls()`).

    Returns:
      [B, T, N, Hv] in the query dtype, and the weights if requested.
    """
    _check_shapes(query, key, value, mask, bias, alibi_slopes)
    if impl not in _IMPLS:
        raise ValueError(f"attention_impl={impl!r} is unknown; choose from {attention_impls()}")
    if not deterministic and dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dot_product_attention: dropout_rate > 0 needs a dropout_rng")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _IMPLS[impl](
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        alibi_slopes=alibi_slopes,
        scale=scale,
        dropout_rate=0.0 if deterministic else dropout_rate,
        dropout_rng=dropout_rng,
        return_weights=return_weights,
    )


def _check_shapes(query, key, value, mask, bias, alibi_slopes) -> None:
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            "dot_product_attention expects query [B,T,N,H], key [B,S,K,H], value [B,S,K,Hv]; "
            f"got shapes {query.shape}, {key.shape}, {value.shape}"
        )
    B, T, N, H = query.shape
    _, S, K, Hk = key.shape
    if Hk != H or key.shape[0] != B or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"query {query.shape}, key {key.shape} and value {value.shape} disagree on B, S, K or H"
        )
    if N % K:
        raise ValueError(f"num_heads={N} must be divisible by num_kv_heads={K}")
    target = (B, N, T, S)
    for name, arr in (("mask", mask), ("bias", bias)):
        if arr is None or isinstance(arr, AttentionMask):
            continue
        if arr.ndim != 4 or any(a not in (1, t) for a, t in zip(arr.shape, target, strict=True)):
            raise ValueError(
                f"{name} of shape {arr.shape} is not broadcastable to [B,N,T,S]={target}")
    if alibi_slopes is not None and alibi_slopes.shape != (N,):
        raise ValueError(f"alibi_slopes has shape {alibi_slopes.shape}, expected ({N},)")


def alibi_bias(slopes: Array, q_positions: Array, kv_positions: Array) -> Array:
    """ALiBi bias -slope_n * |q_pos - k_pos|: [B|1, N, T, S] float32."""
    dist = jnp.abs(q_positions[:, None, :, None] - kv_positions[:, None, None, :])
    return -slopes.astype(jnp.float32)[None, :, None, None] * dist.astype(jnp.float32)


def _positions(mask, length_q, length_kv):
    if isinstance(mask, AttentionMask):
        return mask.q_positions, mask.kv_positions
    return jnp.arange(length_q)[None], jnp.arange(length_kv)[None]


def attention_scores(query: Array, key: Array, scale: float) -> Array:
    """Q K^T * scale with GQA grouping: [B, N, T, S] float32 (key [B, S, K, H])."""
    return kv_major_scores(query, jnp.swapaxes(key, 1, 2), scale)


def kv_major_scores(query: Array, key_t: Array, scale: float) -> Array:
    """Scores from a head-major key [B, K, S, H] (the KV cache layout): [B, N, T, S].

    With K leading S, the contraction over H needs no transpose of the keys,
    which matters when the same long cache is read at every decoding step.
    """
    B, T, N, H = query.shape
    K = key_t.shape[1]
    q = query.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bksh->bkgts", q, key_t, preferred_element_type=jnp.float32)
    return scores.reshape(B, N, T, -1) * jnp.float32(scale)


def masked_softmax(scores: Array, mask: Array | None) -> Array:
    """Float32 softmax over the last axis; fully masked rows give zeros."""
    scores = scores.astype(jnp.float32)
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    weights = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    # A row with no visible key is uniform over masked keys; zero it instead.
    return weights * jnp.any(mask, axis=-1, keepdims=True)


def weighted_values(weights: Array, value: Array, dtype) -> Array:
    """Weights [B, N, T, S] times value [B, S, K, Hv] -> [B, T, N, Hv]."""
    return kv_major_values(weights, jnp.swapaxes(value, 1, 2), dtype)


def kv_major_values(weights: Array, value_t: Array, dtype) -> Array:
    """Weights [B, N, T, S] times a head-major value [B, K, S, Hv] -> [B, T, N, Hv]."""
    B, N, T, S = weights.shape
    K = value_t.shape[1]
    w = weights.astype(dtype).reshape(B, K, N // K, T, S)
    out = jnp.einsum("bkgts,bksh->btkgh", w, value_t.astype(dtype))
    return out.reshape(B, T, N, -1)


def attention_dropout(weights: Array, rate: float, rng: Array | None) -> Array:
    """Inverted dropout on attention weights (identity when rate == 0)."""
    if rate <= 0.0:
        return weights
    return dropout(weights, rate, rng)


def _xla_attention(query, key, value, *, mask, bias, alibi_slopes, scale, dropout_rate,
                   dropout_rng, return_weights):
    return kv_major_attention(
        query, jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2), mask=mask, bias=bias,
        alibi_slopes=alibi_slopes, scale=scale, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, return_weights=return_weights)


def kv_major_attention(query, key_t, value_t, *, mask=None, bias=None, alibi_slopes=None,
                       scale=None, dropout_rate=0.0, dropout_rng=None, return_weights=False):
    """The reference computation on head-major keys/values [B, K, S, H].

    Used by `xla` and directly by incremental decoding, whose cache is stored
    head-major; arguments as in `dot_product_attention`.
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = kv_major_scores(query, key_t, scale)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    if alibi_slopes is not None:
        q_pos, kv_pos = _positions(mask, query.shape[1], key_t.shape[2])
        scores = scores + alibi_bias(alibi_slopes, q_pos, kv_pos)
    dense = mask.dense_mask() if isinstance(mask, AttentionMask) else mask
    weights = masked_softmax(scores, dense)
    out = kv_major_values(attention_dropout(weights, dropout_rate, dropout_rng), value_t,
                          query.dtype)
    return (out, weights) if return_weights else out


register_attention_impl("xla", _xla_attention)

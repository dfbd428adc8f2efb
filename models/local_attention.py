"""Sliding-window (local) attention in O(T * w) compute and memory.

The window comes from `AttentionMask.window` (w): with `causal`, a query at
position p sees keys in (p - w, p]; without, keys with |p - q| <= w // 2.
Queries are cut into blocks of b tokens (b = w causal, w // 2 bidirectional);
a block can only reach its own and a fixed number of neighbouring key blocks,
so each query block attends to that short strip of keys ([B * nb, b, ...]
against [B * nb, (before + 1 + after) * b, ...]) and the usual dense machinery
of `models.dot_product` runs on the strips. Gradients come from autodiff; the
strips already keep memory O(T * w).

The exact `AttentionMask` is applied inside each strip, so the result equals
dense masked attention whenever every visible key lies within the strip: true
for self-attention (T == S) whose positions advance by one per token within a
segment (plain or packed sequences, which is what models build).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from transformer_zoo.models.dot_product import (
    alibi_bias,
    attention_dropout,
    attention_scores,
    masked_softmax,
    register_attention_impl,
    weighted_values,
)
from transformer_zoo.models.masks import AttentionMask

Array = Any


def local_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: AttentionMask,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
    """Attention restricted to `mask.window`, visiting only neighbouring blocks.

    Args:
      query: [B, T, N, H].
      key: [B, S, K, H] with S == T (self-attention).
      value: [B, S, K, Hv].
      mask: an `AttentionMask` with `window` set (and no `dense` extra).
      alibi_slopes: optional [N] ALiBi slopes.
      scale: score scale, default 1 / sqrt(H).
      dropout_rate: dropout on the attention weights.
      dropout_rng: PRNG key for that dropout.

    Returns:
      [B, T, N, Hv] in the query dtype.
    """
    _check_local(query, key, mask)
    B, T, N, H = query.shape
    block, before, after = _strip_geometry(mask.window, mask.causal, T)
    scale = H**-0.5 if scale is None else scale
    qb = _blocks(query, block)
    kb = _strips(key, block, before, after)
    vb = _strips(value, block, before, after)
    tile_mask = _strip_mask(mask, B, T, block, before, after)
    scores = attention_scores(qb, kb, scale)  # [B * nb, N, b, L]
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, tile_mask.q_positions, tile_mask.kv_positions)
    weights = masked_softmax(scores, tile_mask.block())
    weights = attention_dropout(weights, dropout_rate, dropout_rng)
    out = weighted_values(weights, vb, query.dtype)  # [B * nb, b, N, Hv]
    return out.reshape(B, -1, N, out.shape[-1])[:, :T]


def _check_local(query: Array, key: Array, mask) -> None:
    if not isinstance(mask, AttentionMask) or mask.window is None:
        raise ValueError("attention_impl='local' needs mask=AttentionMask(..., window=w); "
                         f"got mask of type {type(mask).__name__} with no window")
    if mask.window < 1:
        raise ValueError(f"attention_impl='local' needs window >= 1, got {mask.window}")
    if mask.dense is not None:
        raise ValueError("attention_impl='local' does not take AttentionMask.dense; "
                         "use attention_impl='blockwise' or 'xla'")
    if query.shape[1] != key.shape[1]:
        raise ValueError("attention_impl='local' is for self-attention (T == S); got "
                         f"T={query.shape[1]}, S={key.shape[1]}")


def _strip_geometry(window: int, causal: bool, T: int) -> tuple[int, int, int]:
    """Block length and how many key blocks before/after each query block to visit."""
    reach_back = window - 1 if causal else window // 2
    reach_fwd = 0 if causal else window // 2
    block = max(1, min(T, window if causal else window // 2))
    n_blocks = -(-T // block)
    before = min(math.ceil(reach_back / block), n_blocks - 1)
    after = min(math.ceil(reach_fwd / block), n_blocks - 1)
    return block, before, after


def _pad_tokens(x: Array, front: int, back: int, value=0) -> Array:
    widths = [(0, 0)] * x.ndim
    widths[1] = (front, back)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x: Array, block: int) -> Array:
    """[B, T, ...] -> [B * nb, block, ...] (zero padded)."""
    x = _pad_tokens(x, 0, -x.shape[1] % block)
    return x.reshape(-1, block, *x.shape[2:])


def _strips(x: Array, block: int, before: int, after: int, value=0) -> Array:
    """[B, S, ...] -> [B * nb, (before + 1 + after) * block, ...]: each query
    block's own key block with its neighbours (padding outside the sequence)."""
    B, S = x.shape[:2]
    nb = -(-S // block)
    x = _pad_tokens(x, before * block, (nb * block - S) + after * block, value)
    x = x.reshape(B, nb + before + after, block, *x.shape[2:])
    views = [x[:, d : d + nb] for d in range(before + after + 1)]
    strips = jnp.concatenate(views, axis=2)  # [B, nb, L, ...]
    return strips.reshape(B * nb, -1, *x.shape[3:])


def _strip_mask(mask: AttentionMask, B: int, T: int, block: int, before: int,
                after: int) -> AttentionMask:
    """The AttentionMask of every (query block, key strip) pair, batch B * nb.

    Keys outside the sequence get segment id 0, so the mask hides them.
    """
    def per_token(x):
        # Missing segment ids mean one segment, as in AttentionMask.block.
        return jnp.broadcast_to(jnp.ones((), jnp.int32) if x is None else x, (B, T))

    q_pos, kv_pos = per_token(mask.q_positions), per_token(mask.kv_positions)
    q_seg, kv_seg = per_token(mask.q_segment_ids), per_token(mask.kv_segment_ids)
    return AttentionMask(
        q_positions=_blocks(q_pos, block),
        kv_positions=_strips(kv_pos, block, before, after),
        q_segment_ids=_blocks(q_seg, block),
        kv_segment_ids=_strips(kv_seg, block, before, after, value=0),
        causal=mask.causal,
        window=mask.window,
    )


def _local_impl(query, key, value, *, mask, bias, alibi_slopes, scale, dropout_rate,
                dropout_rng, return_weights):
    if return_weights or bias is not None:
        raise ValueError("attention_impl='local' supports neither return_weights=True nor a dense "
                         "bias; use attention_impl='xla'")
    return local_attention(query, key, value, mask=mask, alibi_slopes=alibi_slopes, scale=scale,
                           dropout_rate=dropout_rate, dropout_rng=dropout_rng)


register_attention_impl("local", _local_impl)

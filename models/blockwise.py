"""Memory-efficient (blockwise, "flash") attention in pure JAX.

The online-softmax algorithm (Rabe & Staats 2021; Dao et al. 2022): queries
and keys are cut into blocks; for each query block a running maximum `m`, a
running sum `l` and an unnormalised output `acc` are updated key block by key
block, so only a [Tb, Sb] tile of scores ever exists. A `jax.custom_vjp`
recomputes the tiles in the backward pass from the saved log-sum-exp, so the
backward pass stores no [T, S] matrix either: memory is O((T + S) * block).
A problem that fits in one tile has no memory to save and is computed as plain
softmax attention, differentiated by autodiff (`single_tile`).

Masks are evaluated per tile from an `AttentionMask` (positions, segment ids,
causality, window, dense extra): tiles with no visible key (the future under a
causal mask, other windows) are skipped, and only the tiles a mask cuts
through apply it. Lengths that are not multiples of the block sizes are padded
internally; padded keys get segment id 0 so the mask hides them.

This file lays the inputs out in tiles; models/blockwise_tiles.py runs the
loops over them: queries [nq, B * K, G * bq, H], keys [nk, B * K, bk, H] (GQA:
query head n = k * G + g uses key head k, as in `attention_scores`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from transformer_zoo.models.blockwise_tiles import MaskBlocks, TileConfig, flash, single_tile
from transformer_zoo.models.dot_product import register_attention_impl
from transformer_zoo.models.masks import AttentionMask

Array = Any

# Tile sizes (benchmarks/attention.py): at 512 x 512 each tile's batched
# matmuls run near the GEMM kernels' peak and amortise the per-tile work, while
# a causal mask still skips all but (n + 1) / 2n of the tiles (n = N / 512).
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


def blockwise_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | AttentionMask | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> Array:
    """Softmax attention computed tile by tile, in O((T + S) * block) memory.

    Args:
      query: [B, T, N, H].
      key: [B, S, K, H], N = K * G.
      value: [B, S, K, Hv].
      mask: None, a bool array broadcastable to [B, N, T, S] (sliced per tile)
        or an `AttentionMask` (evaluated per tile).
      alibi_slopes: [N] slopes; adds -slope * |q_pos - kv_pos|.
      scale: score scale, default 1 / sqrt(H).
      dropout_rate: dropout on the attention weights; the keep mask of tile
        (i, j) comes from `dropout_rng` folded with i and j, so the backward
        pass regenerates exactly the forward's mask.
      dropout_rng: PRNG key, needed when dropout_rate > 0.
      block_q: query tile length.
      block_kv: key tile length.

    Returns:
      [B, T, N, Hv] in the query dtype.
    """
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("blockwise_attention: dropout_rate > 0 needs a dropout_rng")
    bq, bk = min(block_q, T), min(block_kv, S)
    mask = _as_attention_mask(mask, T, S)
    cfg = TileConfig(
        batch=B,
        kv_heads=K,
        groups=N // K,
        block_q=bq,
        block_kv=bk,
        dropout_rate=float(dropout_rate),
        causal=mask is not None and mask.causal,
        window=None if mask is None else mask.window,
        has_mask=mask is not None or S % bk != 0,
        segments=S % bk != 0 or (mask is not None and (
            mask.q_segment_ids is not None or mask.kv_segment_ids is not None)),
    )
    blocks = _mask_blocks(mask, T, S, N, bq, bk)
    slopes = None if alibi_slopes is None else alibi_slopes.astype(jnp.float32).reshape(K, N // K)
    # Scaling the queries once (not every tile's scores) saves a pass over each
    # [bq, bk] tile; autodiff scales dQ by the same factor outside `flash`.
    scale = H**-0.5 if scale is None else scale
    scaled = query * jnp.asarray(scale, query.dtype)
    q, k, v = _q_blocks(scaled, K, bq), _kv_blocks(key, bk), _kv_blocks(value, bk)
    # One tile (T <= block_q and S <= block_kv) has no memory to save: plain autodiff.
    tiles = single_tile if q.shape[0] == k.shape[0] == 1 else flash
    out = tiles(cfg, q, k, v, slopes, blocks, dropout_rng if dropout_rate > 0.0 else None)
    # [nq, B * K, G * bq, Hv] -> [B, T, N, Hv]
    Hv = value.shape[-1]
    out = out.reshape(-1, B, K, N // K, bq, Hv).transpose(1, 0, 4, 2, 3, 5)
    return out.reshape(B, -1, N, Hv)[:, :T].astype(query.dtype)


def _as_attention_mask(mask, T: int, S: int) -> AttentionMask | None:
    if mask is None or isinstance(mask, AttentionMask):
        return mask
    return AttentionMask(
        q_positions=jnp.arange(T, dtype=jnp.int32)[None],
        kv_positions=jnp.arange(S, dtype=jnp.int32)[None],
        dense=jnp.asarray(mask, bool),
    )


def _pad_axis(x: Array, axis: int, block: int, value=0) -> Array:
    pad = -x.shape[axis] % block
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _q_blocks(query: Array, K: int, bq: int) -> Array:
    """[B, T, N, H] -> [nq, B * K, G * bq, H] (zero padded)."""
    B, _, N, H = query.shape
    q = _pad_axis(query, 1, bq)
    q = q.reshape(B, -1, bq, K, N // K, H).transpose(1, 0, 3, 4, 2, 5)
    return q.reshape(q.shape[0], B * K, -1, H)


def _kv_blocks(x: Array, bk: int) -> Array:
    """[B, S, K, H] -> [nk, B * K, bk, H] (zero padded)."""
    B, _, K, H = x.shape
    x = _pad_axis(x, 1, bk).reshape(B, -1, bk, K, H).transpose(1, 0, 3, 2, 4)
    return x.reshape(x.shape[0], B * K, bk, H)


def _token_blocks(x: Array, block: int, value: int) -> Array:
    """[B|1, L] -> [n, B|1, block], padded with `value`."""
    x = _pad_axis(jnp.asarray(x), 1, block, value)
    return x.reshape(x.shape[0], -1, block).transpose(1, 0, 2)


def _mask_blocks(mask: AttentionMask | None, T: int, S: int, N: int, bq: int, bk: int):
    """Cuts the mask's per-token arrays into tiles; padded keys get segment 0."""
    if mask is None:
        q_pos = jnp.arange(T, dtype=jnp.int32)[None]
        kv_pos = jnp.arange(S, dtype=jnp.int32)[None]
        q_seg = kv_seg = dense = None
    else:
        q_pos, kv_pos, dense = mask.q_positions, mask.kv_positions, mask.dense
        q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
    # Missing segment ids mean "one segment" (as in AttentionMask.block).
    q_seg = jnp.ones(q_pos.shape, jnp.int32) if q_seg is None else q_seg
    kv_seg = jnp.ones(kv_pos.shape, jnp.int32) if kv_seg is None else kv_seg
    return MaskBlocks(
        q_pos=_token_blocks(q_pos, bq, 0),
        q_seg=_token_blocks(q_seg, bq, 0),
        kv_pos=_token_blocks(kv_pos, bk, 0),
        kv_seg=_token_blocks(kv_seg, bk, 0),
        dense=None if dense is None else _dense_blocks(dense, bq, bk),
    )


def _dense_blocks(dense: Array, bq: int, bk: int) -> Array:
    """[B|1, N|1, T|1, S|1] -> [nq|1, nk|1, B|1, N|1, bq|1, bk|1], padded False."""
    d = jnp.asarray(dense, bool)
    Bd, Nd, Td, Sd = d.shape
    if Td > 1:
        d = _pad_axis(d, 2, bq, False)
    if Sd > 1:
        d = _pad_axis(d, 3, bk, False)
    tq = (d.shape[2] // bq, bq) if Td > 1 else (1, 1)
    tk = (d.shape[3] // bk, bk) if Sd > 1 else (1, 1)
    d = d.reshape(Bd, Nd, *tq, *tk)
    return d.transpose(2, 4, 0, 1, 3, 5)


def make_blockwise_impl(block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV):
    """An `attention_impl` function with the given tile sizes (for registering)."""

    def impl(query, key, value, *, mask, bias, alibi_slopes, scale, dropout_rate,
             dropout_rng, return_weights):
        if return_weights:
            raise ValueError("attention_impl='blockwise' never materialises the weights; "
                             "return_weights=True needs attention_impl='xla'")
        if bias is not None:
            raise ValueError("attention_impl='blockwise' takes no dense [B,N,T,S] bias (it would "
                             "cost the O(T*S) memory it avoids); pass masks as mask= and ALiBi as "
                             "alibi_slopes=, or use attention_impl='xla'")
        return blockwise_attention(query, key, value, mask=mask, alibi_slopes=alibi_slopes,
                                   scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                                   block_q=block_q, block_kv=block_kv)

    return impl


register_attention_impl("blockwise", make_blockwise_impl())

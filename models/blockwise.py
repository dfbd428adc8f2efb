"""Memory-efficient (blockwise, "flash") attention in pure JAX.

The online-softmax algorithm (Rabe & Staats 2021; Dao et al. 2022): queries
and keys are cut into blocks; for each query block a running maximum `m`, a
running sum `l` and an unnormalised output `acc` are updated key block by key
block, so only a [Tb, Sb] tile of scores ever exists. A `jax.custom_vjp`
recomputes the tiles in the backward pass from the saved log-sum-exp, so the
backward pass stores no [T, S] matrix either: memory is O((T + S) * block).

Masks are evaluated per tile from an `AttentionMask` (positions, segment ids,
causality, window, dense extra) and tiles with no visible key (the future
under a causal mask, other windows) are skipped with `lax.cond`. Lengths that
are not multiples of the block sizes are padded internally; padded keys get
segment id 0 so the mask hides them.

Internal layout: queries [nq, B, K, G, bq, H], keys [nk, B, K, bk, H] (GQA:
query head n = k * G + g uses key head k, as in `attention_scores`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer_zoo.models.dot_product import register_attention_impl
from transformer_zoo.models.dropout import keep_mask, keep_probability
from transformer_zoo.models.masks import NEG_INF, AttentionMask

Array = Any

# CPU-tuned defaults (benchmarks/attention.py): big enough that each tile's
# matmuls amortise the loop overhead, small enough to stay in cache.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_KV = 256


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) settings of one call."""

    block_q: int
    block_kv: int
    scale: float
    dropout_rate: float
    causal: bool
    window: int | None
    has_mask: bool


class _MaskBlocks(NamedTuple):
    """Per-token mask inputs cut into blocks (integer/bool, not differentiated).

    q_pos/q_seg: [nq, B|1, bq]; kv_pos/kv_seg: [nk, B|1, bk];
    dense: None or [nq|1, nk|1, B|1, N|1, bq|1, bk|1] bool.
    """

    q_pos: Array
    q_seg: Array
    kv_pos: Array
    kv_seg: Array
    dense: Array | None


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
    cfg = _Config(
        block_q=bq,
        block_kv=bk,
        scale=float(H**-0.5 if scale is None else scale),
        dropout_rate=float(dropout_rate),
        causal=mask is not None and mask.causal,
        window=None if mask is None else mask.window,
        has_mask=mask is not None or S % bk != 0,
    )
    blocks = _mask_blocks(mask, T, S, N, bq, bk)
    slopes = None if alibi_slopes is None else alibi_slopes.astype(jnp.float32).reshape(K, N // K)
    out = _flash(cfg, _q_blocks(query, K, bq), _kv_blocks(key, bk), _kv_blocks(value, bk),
                 slopes, blocks, dropout_rng if dropout_rate > 0.0 else None)
    # [nq, B, K, G, bq, Hv] -> [B, T, N, Hv]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, -1, N, value.shape[-1])
    return out[:, :T].astype(query.dtype)


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
    """[B, T, N, H] -> [nq, B, K, G, bq, H] (zero padded)."""
    B, _, N, H = query.shape
    q = _pad_axis(query, 1, bq)
    q = q.reshape(B, -1, bq, K, N // K, H)
    return q.transpose(1, 0, 3, 4, 2, 5)


def _kv_blocks(x: Array, bk: int) -> Array:
    """[B, S, K, H] -> [nk, B, K, bk, H] (zero padded)."""
    B, _, K, H = x.shape
    x = _pad_axis(x, 1, bk).reshape(B, -1, bk, K, H)
    return x.transpose(1, 0, 3, 2, 4)


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
    return _MaskBlocks(
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


def _tile_mask(cfg: _Config, blocks: _MaskBlocks, i, j, K: int, G: int) -> Array:
    """The [B|1, K|1, G|1, bq, bk] bool mask of tile (i, j)."""
    dense = None
    if blocks.dense is not None:
        d = blocks.dense
        dense = d[i if d.shape[0] > 1 else 0, j if d.shape[1] > 1 else 0]
    tile = AttentionMask(
        q_positions=blocks.q_pos[i],
        kv_positions=blocks.kv_pos[j],
        q_segment_ids=blocks.q_seg[i],
        kv_segment_ids=blocks.kv_seg[j],
        dense=dense,
        causal=cfg.causal,
        window=cfg.window,
    ).block()
    b, n, tq, tk = tile.shape
    return tile.reshape(b, K, G, tq, tk) if n > 1 else tile[:, :, None]


def _tile_distance(blocks: _MaskBlocks, i, j) -> Array:
    """|q_pos - kv_pos| of tile (i, j): [B|1, 1, 1, bq, bk] float32 (for ALiBi)."""
    delta = blocks.q_pos[i][:, :, None] - blocks.kv_pos[j][:, None, :]
    return jnp.abs(delta).astype(jnp.float32)[:, None, None]


def _tile_scores(cfg, q_i, k_j, slopes, blocks, i, j):
    """Scaled (and ALiBi-biased) float32 scores [B, K, G, bq, bk] and the tile mask."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
    s = s * jnp.float32(cfg.scale)
    if slopes is not None:
        s = s - slopes[None, :, :, None, None] * _tile_distance(blocks, i, j)
    K, G = q_i.shape[1], q_i.shape[2]
    mask = _tile_mask(cfg, blocks, i, j, K, G) if cfg.has_mask else None
    return s, mask


def _keep_mask(cfg: _Config, rng, i, j, shape) -> Array:
    """Dropout keep mask of tile (i, j): a pure function of (rng, i, j)."""
    tile_rng = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    return keep_mask(tile_rng, cfg.dropout_rate, shape)


def _dropped(cfg: _Config, x: Array, keep: Array | None) -> Array:
    if keep is None:
        return x
    return jnp.where(keep, x / keep_probability(cfg.dropout_rate), 0.0)


def _when_visible(mask: Array | None, compute, carry):
    """Runs `compute(carry)` unless the tile is fully masked (then skips it)."""
    if mask is None:
        return compute(carry)
    return lax.cond(jnp.any(mask), compute, lambda c: c, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, slopes, blocks, rng):
    return _forward(cfg, q, k, v, slopes, blocks, rng)[0]


def _forward(cfg, q, k, v, slopes, blocks, rng):
    """Online softmax over key tiles for every query tile.

    Returns:
      out [nq, B, K, G, bq, Hv] float32 and lse [nq, B, K, G, bq] float32
      (0 on rows with no visible key, whose output is 0).
    """
    nk = k.shape[0]

    def query_tile(i):
        q_i = q[i]
        acc0 = jnp.zeros(q_i.shape[:-1] + v.shape[-1:], jnp.float32)
        m0 = jnp.full(q_i.shape[:-1], NEG_INF, jnp.float32)
        l0 = jnp.zeros(q_i.shape[:-1], jnp.float32)

        def key_tile(j, carry):
            s, mask = _tile_scores(cfg, q_i, k[j], slopes, blocks, i, j)
            return _when_visible(mask, functools.partial(_online_step, cfg, s, mask, v[j],
                                                          rng, i, j), carry)

        m, total, acc = lax.fori_loop(0, nk, key_tile, (m0, l0, acc0))
        seen = total > 0
        total = jnp.where(seen, total, 1.0)
        return acc / total[..., None], jnp.where(seen, m + jnp.log(total), 0.0)

    return lax.map(query_tile, jnp.arange(q.shape[0]))


def _online_step(cfg, s, mask, v_j, rng, i, j, carry):
    """One online-softmax update of (max, sum, acc) with the tile's scores."""
    m, total, acc = carry
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    if mask is not None:
        # A row masked so far has m_new == NEG_INF and exp(0) == 1: zero it.
        p = jnp.where(mask, p, 0.0)
    corr = jnp.exp(m - m_new)
    keep = _keep_mask(cfg, rng, i, j, p.shape) if rng is not None else None
    pv = _dropped(cfg, p, keep).astype(v_j.dtype)
    pv = jnp.einsum("bkgqs,bksh->bkgqh", pv, v_j, preferred_element_type=jnp.float32)
    return m_new, total * corr + p.sum(-1), acc * corr[..., None] + pv


def _flash_fwd(cfg, q, k, v, slopes, blocks, rng):
    out, lse = _forward(cfg, q, k, v, slopes, blocks, rng)
    return out, (q, k, v, slopes, blocks, rng, out, lse)


def _flash_bwd(cfg, res, d_out):
    """Recomputes each visible tile once: dK, dV per key tile, dQ accumulated."""
    q, k, v, slopes, blocks, rng, out, lse = res
    # delta = rowsum(dO * O): the softmax Jacobian term, also valid with
    # dropout since O already carries the dropped weights.
    delta = jnp.sum(d_out * out, axis=-1)
    d_out = d_out.astype(v.dtype)

    def key_tile(dq, j):
        dk0 = jnp.zeros(k.shape[1:], jnp.float32)
        dv0 = jnp.zeros(v.shape[1:], jnp.float32)
        dsl0 = jnp.zeros(q.shape[2:4], jnp.float32)

        def query_tile(i, carry):
            s, mask = _tile_scores(cfg, q[i], k[j], slopes, blocks, i, j)
            tile = _TileGrad(cfg, q[i], k[j], v[j], d_out[i], lse[i], delta[i], blocks, rng,
                             alibi=slopes is not None)
            return _when_visible(mask, functools.partial(tile.step, s, mask, i, j), carry)

        dq, dk, dv, dsl = lax.fori_loop(0, q.shape[0], query_tile, (dq, dk0, dv0, dsl0))
        return dq, (dk, dv, dsl)

    dq, (dk, dv, dsl) = lax.scan(key_tile, jnp.zeros(q.shape, jnp.float32), jnp.arange(k.shape[0]))
    dslopes = None if slopes is None else dsl.sum(0)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dslopes, None, None)


@dataclasses.dataclass
class _TileGrad:
    """Inputs of one tile's backward step (keeps the step's signature short)."""

    cfg: _Config
    q_i: Array
    k_j: Array
    v_j: Array
    do_i: Array
    lse_i: Array
    delta_i: Array
    blocks: _MaskBlocks
    rng: Array | None
    alibi: bool

    def step(self, s, mask, i, j, carry):
        """Adds tile (i, j)'s contributions to (dq, dk_j, dv_j, dslopes)."""
        dq, dk, dv, dsl = carry
        cfg = self.cfg
        p = jnp.exp(s - self.lse_i[..., None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        keep = _keep_mask(cfg, self.rng, i, j, p.shape) if self.rng is not None else None
        pd = _dropped(cfg, p, keep).astype(self.do_i.dtype)
        f32 = jnp.float32
        dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", pd, self.do_i, preferred_element_type=f32)
        dp = jnp.einsum("bkgqh,bksh->bkgqs", self.do_i, self.v_j, preferred_element_type=f32)
        ds = p * (_dropped(cfg, dp, keep) - self.delta_i[..., None])
        dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, self.k_j, preferred_element_type=jnp.float32)
        dq = dq.at[i].add(dq_i * cfg.scale)
        dk_j = jnp.einsum("bkgqs,bkgqh->bksh", ds, self.q_i, preferred_element_type=jnp.float32)
        dk = dk + dk_j * cfg.scale
        if self.alibi:
            dist = _tile_distance(self.blocks, i, j)
            dsl = dsl - jnp.sum(ds * dist, axis=(0, 3, 4))
        return dq, dk, dv, dsl


_flash.defvjp(_flash_fwd, _flash_bwd)


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

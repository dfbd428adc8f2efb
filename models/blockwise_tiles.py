"""The tile loops of blockwise attention: online softmax forward, recomputing backward.

`flash` is a `jax.custom_vjp` over tiles laid out by models/blockwise.py:
queries [nq, R, G * bq, H] and keys/values [nk, R, bk, H], with R = B * K
rows of (batch, key head) and the G query heads sharing a key head stacked
along the query axis (GQA: query head n = k * G + g uses key head k). Every
product is then one batched matmul over R whose left operand contracts its
last axis, the layout GEMM kernels take directly; the two backward products
that contract over queries are formed transposed (dV^T = dO^T P,
dK^T = Q^T dS) from Q^T and dO^T written once, as K^T and V^T are for the
scores and dP, instead of XLA transposing a tile per step. Tiles are classified once
per call (hidden / cut by the mask / wholly visible); hidden tiles are
skipped and only cut tiles evaluate and apply the mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer_zoo.models.dropout import keep_mask, keep_probability
from transformer_zoo.models.masks import NEG_INF, AttentionMask

Array = Any

# Tile classes: what the mask leaves visible of a tile.
HIDDEN, PARTIAL, VISIBLE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static (hashable) settings of one call."""

    batch: int
    kv_heads: int
    groups: int
    block_q: int
    block_kv: int
    dropout_rate: float
    causal: bool
    window: int | None
    has_mask: bool


class MaskBlocks(NamedTuple):
    """Per-token mask inputs cut into blocks (integer/bool, not differentiated).

    q_pos/q_seg: [nq, B|1, bq]; kv_pos/kv_seg: [nk, B|1, bk];
    dense: None or [nq|1, nk|1, B|1, N|1, bq|1, bk|1] bool.
    """

    q_pos: Array
    q_seg: Array
    kv_pos: Array
    kv_seg: Array
    dense: Array | None


def _rows(cfg: TileConfig, x: Array) -> Array:
    """[B|1, K|1, G|1, bq, bk] -> [R, G * bq, bk], the tiles' layout."""
    B, K, G = cfg.batch, cfg.kv_heads, cfg.groups
    x = jnp.broadcast_to(x, (B, K, G) + x.shape[-2:])
    return x.reshape(B * K, G * x.shape[-2], x.shape[-1])


def _tile_mask(cfg: TileConfig, blocks: MaskBlocks, i, j) -> Array:
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
    return tile.reshape(b, cfg.kv_heads, cfg.groups, tq, tk) if n > 1 else tile[:, :, None]


def _tile_distance(blocks: MaskBlocks, i, j) -> Array:
    """|q_pos - kv_pos| of tile (i, j): [B|1, 1, 1, bq, bk] float32 (for ALiBi)."""
    delta = blocks.q_pos[i][:, :, None] - blocks.kv_pos[j][:, None, :]
    return jnp.abs(delta).astype(jnp.float32)[:, None, None]


def _alibi_bias(cfg: TileConfig, slopes: Array, blocks: MaskBlocks, i, j) -> Array:
    """slope * |q_pos - kv_pos| of tile (i, j): [R, G * bq, bk]."""
    return _rows(cfg, slopes[None, :, :, None, None] * _tile_distance(blocks, i, j))


def _tile_scores(cfg, q_i, k_t, slopes, blocks, i, j):
    """(ALiBi-biased) float32 scores [R, G * bq, bk] of pre-scaled queries.

    k_t is the key tile transposed, [R, H, bk], as the GEMM kernels read it.
    """
    s = jnp.einsum("rqh,rhs->rqs", q_i, k_t, preferred_element_type=jnp.float32)
    if slopes is not None:
        s = s - _alibi_bias(cfg, slopes, blocks, i, j)
    return s


def _keep_mask(cfg: TileConfig, rng, i, j) -> Array:
    """Dropout keep mask of tile (i, j), [R, G * bq, bk]: a pure function of (rng, i, j).

    Drawn as [B, K, G, bq, bk], so the bits do not depend on the layout.
    """
    tile_rng = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    shape = (cfg.batch, cfg.kv_heads, cfg.groups, cfg.block_q, cfg.block_kv)
    return _rows(cfg, keep_mask(tile_rng, cfg.dropout_rate, shape))


def _dropped(cfg: TileConfig, x: Array, keep: Array | None) -> Array:
    if keep is None:
        return x
    return jnp.where(keep, x / keep_probability(cfg.dropout_rate), 0.0)


def tile_classes(cfg: TileConfig, blocks: MaskBlocks) -> Array | None:
    """[nq, nk] int32 class of every tile, or None when nothing is masked.

    Decided from each tile's least and greatest position and segment id (and
    the dense mask's tile, if any), so it costs O(nq * nk) and no tile's mask
    is evaluated. The class is conservative: a tile called PARTIAL may be
    wholly visible or hidden (it then evaluates its mask exactly), but HIDDEN
    and VISIBLE are certain. Computed once per call; the backward pass reuses
    the forward's.
    """
    if not cfg.has_mask:
        return None
    q = _Extent(blocks.q_pos, blocks.q_seg, rows=True)
    kv = _Extent(blocks.kv_pos, blocks.kv_seg, rows=False)
    # Segment 0 is padding and sees nothing; other segments see only themselves.
    hidden = (q.seg_max < kv.seg_min) | (q.seg_min > kv.seg_max)
    hidden |= (q.seg_max == 0) | (kv.seg_max == 0)
    visible = (q.seg_min == q.seg_max) & (kv.seg_min == kv.seg_max) & (q.seg_min == kv.seg_min)
    visible &= q.seg_min != 0
    # delta = q_pos - kv_pos ranges over [lo, hi] in the tile.
    lo, hi = q.pos_min - kv.pos_max, q.pos_max - kv.pos_min
    if cfg.causal:
        hidden |= hi < 0
        visible &= lo >= 0
        if cfg.window is not None:
            hidden |= lo >= cfg.window
            visible &= hi < cfg.window
    elif cfg.window is not None:
        half = cfg.window // 2
        hidden |= (lo > half) | (hi < -half)
        visible &= (hi <= half) & (lo >= -half)
    if blocks.dense is not None:
        # [nq|1, nk|1, B|1, N|1, bq|1, bk|1] -> [nq|1, nk|1, B|1]
        dense = blocks.dense.reshape(blocks.dense.shape[:3] + (-1,))
        hidden |= ~dense.any(-1)
        visible &= dense.all(-1)
    # A tile is hidden (visible) only if it is so for every batch row.
    return jnp.where(visible.all(-1), VISIBLE, jnp.where(hidden.all(-1), HIDDEN, PARTIAL))


class _Extent:
    """Least and greatest position and segment id per tile, shaped to broadcast.

    Query tiles come out as [nq, 1, B|1], key tiles as [1, nk, B|1].
    """

    def __init__(self, pos: Array, seg: Array, *, rows: bool):
        axis = 1 if rows else 0

        def extent(x, reduce):
            return jnp.expand_dims(reduce(x, axis=-1), axis)

        self.pos_min, self.pos_max = extent(pos, jnp.min), extent(pos, jnp.max)
        self.seg_min, self.seg_max = extent(seg, jnp.min), extent(seg, jnp.max)


class _Order(NamedTuple):
    """Per outer tile, the inner tiles to visit: the wholly visible ones, then the cut ones.

    order: [n_outer, n_inner] inner indices, VISIBLE first, then PARTIAL, then
    HIDDEN (never visited); visible, cut: [n_outer] counts.
    """

    order: Array
    visible: Array
    cut: Array


def _tile_order(classes: Array | None, inner_axis: int) -> _Order | None:
    if classes is None:
        return None
    rank = jnp.where(classes == VISIBLE, 0, jnp.where(classes == PARTIAL, 1, 2))
    rank = rank if inner_axis == 1 else rank.T
    order = jnp.argsort(rank, axis=1, stable=True).astype(jnp.int32)
    return _Order(order, (rank == 0).sum(1), (rank == 1).sum(1))


def _over_tiles(order: _Order | None, outer, n_inner: int, step, carry):
    """Folds `step(inner, masked, carry)` over the visible inner tiles of `outer`.

    Two loops, with no conditional in either: the wholly visible tiles
    unmasked, then the tiles the mask cuts through, masked. Hidden tiles (the
    future under a causal mask, other windows or segments) are never visited.
    """
    if order is None:
        return lax.fori_loop(0, n_inner, lambda t, c: step(t, False, c), carry)
    row, n_visible = order.order[outer], order.visible[outer]
    carry = lax.fori_loop(0, n_visible, lambda t, c: step(row[t], False, c), carry)
    return lax.fori_loop(n_visible, n_visible + order.cut[outer],
                         lambda t, c: step(row[t], True, c), carry)


def single_tile(cfg, q, k, v, slopes, blocks, rng):
    """`flash` when the whole problem is one tile: plain softmax, differentiated by autodiff.

    One tile has no memory to save, so the backward pass keeps the weights
    instead of recomputing the scores (one matmul fewer, no online rescaling).
    Same inputs, mask, dropout bits (tile (0, 0)) and outputs as `flash`;
    rows that see no key get zero output.
    """
    s = _tile_scores(cfg, q[0], jnp.swapaxes(k[0], -1, -2), slopes, blocks, 0, 0)
    mask = _rows(cfg, _tile_mask(cfg, blocks, 0, 0)) if cfg.has_mask else None
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    # The max only keeps exp in range; softmax does not depend on it.
    p = jnp.exp(s - lax.stop_gradient(s.max(-1, keepdims=True)))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)  # rows that see nothing: exp(0) == 1 everywhere
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    keep = _keep_mask(cfg, rng, 0, 0) if rng is not None else None
    pv = _dropped(cfg, p, keep).astype(v.dtype)
    return jnp.einsum("rqs,rsh->rqh", pv, v[0], preferred_element_type=jnp.float32)[None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash(cfg, q, k, v, slopes, blocks, rng):
    """Blockwise attention of pre-scaled query tiles.

    Args:
      cfg: the call's `TileConfig`.
      q: [nq, R, G * bq, H] queries, already multiplied by the score scale.
      k: [nk, R, bk, H].
      v: [nk, R, bk, Hv].
      slopes: None or [K, G] ALiBi slopes.
      blocks: the `MaskBlocks`.
      rng: None or the dropout PRNG key.

    Returns:
      [nq, R, G * bq, Hv] float32.
    """
    return _forward(cfg, q, k, v, slopes, blocks, rng, tile_classes(cfg, blocks))[0]


def _forward(cfg, q, k, v, slopes, blocks, rng, classes):
    """Online softmax over key tiles for every query tile.

    Returns:
      out [nq, R, G * bq, Hv] float32 and lse [nq, R, G * bq] float32
      (0 on rows with no visible key, whose output is 0).
    """
    nq, nk = q.shape[0], k.shape[0]
    # Transposed once here rather than per tile inside the loop.
    k_t = jnp.swapaxes(k, -1, -2)
    order = _tile_order(classes, inner_axis=1)

    def query_tile(i):
        q_i = q[i]
        acc0 = jnp.zeros(q_i.shape[:-1] + v.shape[-1:], jnp.float32)
        m0 = jnp.full(q_i.shape[:-1], NEG_INF, jnp.float32)
        l0 = jnp.zeros(q_i.shape[:-1], jnp.float32)
        tile = _TileForward(cfg, q_i, k_t, v, slopes, blocks, rng)
        step = functools.partial(tile.step, i)
        m, total, acc = _over_tiles(order, i, nk, step, (m0, l0, acc0))
        seen = total > 0
        total = jnp.where(seen, total, 1.0)
        return acc / total[..., None], jnp.where(seen, m + jnp.log(total), 0.0)

    return lax.map(query_tile, jnp.arange(nq))


@dataclasses.dataclass
class _TileForward:
    """Inputs of one query tile's online softmax (keeps the step's signature short)."""

    cfg: TileConfig
    q_i: Array
    k_t: Array  # [nk, R, H, bk]
    v: Array
    slopes: Array | None
    blocks: MaskBlocks
    rng: Array | None

    def step(self, i, j, masked, carry):
        """One online-softmax update of (max, sum, acc) with key tile j."""
        m, total, acc = carry
        cfg, v_j = self.cfg, self.v[j]
        s = _tile_scores(cfg, self.q_i, self.k_t[j], self.slopes, self.blocks, i, j)
        mask = _rows(cfg, _tile_mask(cfg, self.blocks, i, j)) if masked else None
        if mask is not None:
            s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        if mask is not None:
            # A row masked so far has m_new == NEG_INF and exp(0) == 1: zero it.
            p = jnp.where(mask, p, 0.0)
        corr = jnp.exp(m - m_new)
        keep = _keep_mask(cfg, self.rng, i, j) if self.rng is not None else None
        pv = _dropped(cfg, p, keep).astype(v_j.dtype)
        pv = jnp.einsum("rqs,rsh->rqh", pv, v_j, preferred_element_type=jnp.float32)
        return m_new, total * corr + p.sum(-1), acc * corr[..., None] + pv


def _flash_fwd(cfg, q, k, v, slopes, blocks, rng):
    classes = tile_classes(cfg, blocks)
    out, lse = _forward(cfg, q, k, v, slopes, blocks, rng, classes)
    return out, (q, k, v, slopes, blocks, rng, classes, out, lse)


def _flash_bwd(cfg, res, d_out):
    """Recomputes each visible tile once: dK, dV per key tile, dQ accumulated."""
    q, k, v, slopes, blocks, rng, classes, out, lse = res
    # delta = rowsum(dO * O): the softmax Jacobian term, also valid with
    # dropout since O already carries the dropped weights.
    delta = jnp.sum(d_out * out, axis=-1)
    d_out = d_out.astype(v.dtype)
    queries = _QueryTiles(q, jnp.swapaxes(q, -1, -2), d_out, jnp.swapaxes(d_out, -1, -2),
                          lse, delta)
    k_t, v_t = jnp.swapaxes(k, -1, -2), jnp.swapaxes(v, -1, -2)
    order = _tile_order(classes, inner_axis=0)

    def key_tile(dq, j):
        dk0 = jnp.zeros(k.shape[1:2] + k.shape[3:] + k.shape[2:3], jnp.float32)
        dv0 = jnp.zeros(v.shape[1:2] + v.shape[3:] + v.shape[2:3], jnp.float32)
        dsl0 = jnp.zeros((cfg.kv_heads, cfg.groups), jnp.float32)
        tile = _TileGrad(cfg, queries, k[j], k_t[j], v_t[j], slopes, blocks, rng)

        def query_tile(i, masked, carry):
            return tile.step(i, j, masked, carry)

        dq, dk_t, dv_t, dsl = _over_tiles(order, j, q.shape[0], query_tile, (dq, dk0, dv0, dsl0))
        return dq, (jnp.swapaxes(dk_t, -1, -2), jnp.swapaxes(dv_t, -1, -2), dsl)

    dq, (dk, dv, dsl) = lax.scan(key_tile, jnp.zeros(q.shape, jnp.float32), jnp.arange(k.shape[0]))
    dslopes = None if slopes is None else dsl.sum(0)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dslopes, None, None)


class _QueryTiles(NamedTuple):
    """Per query tile: q, q^T [nq, R, H, G * bq], dO, dO^T, lse and delta."""

    q: Array
    q_t: Array
    do: Array
    do_t: Array
    lse: Array
    delta: Array


@dataclasses.dataclass
class _TileGrad:
    """Inputs of one key tile's backward steps (keeps the step's signature short)."""

    cfg: TileConfig
    queries: _QueryTiles
    k_j: Array
    k_t: Array  # [R, H, bk]
    v_t: Array  # [R, Hv, bk]
    slopes: Array | None
    blocks: MaskBlocks
    rng: Array | None

    def step(self, i, j, masked, carry):
        """Adds tile (i, j)'s contributions to (dq, dk_j^T, dv_j^T, dslopes)."""
        dq, dk_t, dv_t, dsl = carry
        cfg, qs, f32 = self.cfg, self.queries, jnp.float32
        do_t = qs.do_t[i]
        s = _tile_scores(cfg, qs.q[i], self.k_t, self.slopes, self.blocks, i, j)
        p = jnp.exp(s - qs.lse[i][..., None])
        if masked:
            p = jnp.where(_rows(cfg, _tile_mask(cfg, self.blocks, i, j)), p, 0.0)
        keep = _keep_mask(cfg, self.rng, i, j) if self.rng is not None else None
        pd = _dropped(cfg, p, keep).astype(do_t.dtype)
        dv_t = dv_t + jnp.einsum("rhq,rqs->rhs", do_t, pd, preferred_element_type=f32)
        dp = jnp.einsum("rqh,rhs->rqs", qs.do[i], self.v_t, preferred_element_type=f32)
        ds = p * (_dropped(cfg, dp, keep) - qs.delta[i][..., None])
        dq = dq.at[i].add(jnp.einsum("rqs,rsh->rqh", ds, self.k_j, preferred_element_type=f32))
        dk_t = dk_t + jnp.einsum("rhq,rqs->rhs", qs.q_t[i], ds, preferred_element_type=f32)
        if self.slopes is not None:
            ds5 = ds.reshape(cfg.batch, cfg.kv_heads, cfg.groups, cfg.block_q, cfg.block_kv)
            dsl = dsl - jnp.sum(ds5 * _tile_distance(self.blocks, i, j), axis=(0, 3, 4))
        return dq, dk_t, dv_t, dsl


flash.defvjp(_flash_fwd, _flash_bwd)

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
per call (hidden / cut by the mask / wholly visible / cut with a hidden
corner); hidden tiles are skipped and only cut tiles evaluate and apply the
mask. A cut tile whose first half of queries sees none of its second half of
keys is computed as two parts, 3/4 of the tile: the first half of its queries
against the first half of its keys, and the second half of its queries against
all of them. When its first quarter of queries also sees none of its second
quarter of keys (a causal mask's diagonal tiles), the first part splits the
same way again: three parts, 11/16 of the tile.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer_zoo.models.dropout import keep_mask, keep_probability
from transformer_zoo.models.masks import NEG_INF, AttentionMask

Array = Any

# Tile classes: what the mask leaves visible of a tile. CORNER is a PARTIAL
# tile whose first half of queries sees none of its second half of keys;
# NESTED a CORNER tile whose first quarter of queries also sees none of its
# second quarter of keys.
HIDDEN, PARTIAL, VISIBLE, CORNER, NESTED = 0, 1, 2, 3, 4
_SPLIT = (CORNER, NESTED)  # the classes computed in parts (`_corner_parts`)


class _Part(NamedTuple):
    """The static query rows [q0, q1) and keys [k0, k1) of a tile that a step computes."""

    q0: int
    q1: int
    k0: int
    k1: int


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
    # Whether tiles compare segment ids (the mask has them, or padded keys
    # need hiding); without, a cut tile's mask is its positions' alone.
    segments: bool = True


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


def _full(cfg: TileConfig) -> _Part:
    return _Part(0, cfg.block_q, 0, cfg.block_kv)


def _corner_depth(cfg: TileConfig) -> int:
    """How many times cut tiles with hidden corners can be halved: 0, 1 (CORNER) or 2 (NESTED)."""
    if not cfg.has_mask:
        return 0
    if cfg.block_q % 4 == 0 and cfg.block_kv % 4 == 0:
        return 2
    return 1 if cfg.block_q % 2 == 0 and cfg.block_kv % 2 == 0 else 0


def _corner_parts(cfg: TileConfig, kind: int) -> tuple[_Part, ...]:
    """The parts of a CORNER or NESTED tile, in order of their disjoint query rows.

    CORNER: the first half of queries x the first half of keys, the rest x all
    keys. NESTED splits that first part the same way again, skipping 5/16 of
    the tile instead of 1/4. The last part, half the rows against all the keys,
    is large enough to keep the matmul kernels at full speed; splitting it too
    would make every product small (benchmarks/README.md).
    """
    bq, bk = cfg.block_q, cfg.block_kv
    last = _Part(bq // 2, bq, 0, bk)
    if kind == CORNER:
        return _Part(0, bq // 2, 0, bk // 2), last
    return _Part(0, bq // 4, 0, bk // 4), _Part(bq // 4, bq // 2, 0, bk // 2), last


def _part_rows(cfg: TileConfig, x: Array, part: _Part, axis: int = 1) -> Array:
    """The rows [q0, q1) of every group from x's [G * bq] axis (the tiles' query axis)."""
    if (part.q0, part.q1) == (0, cfg.block_q):
        return x
    axis %= x.ndim
    shape = x.shape
    x = x.reshape(shape[:axis] + (cfg.groups, cfg.block_q) + shape[axis + 1:])
    x = lax.slice_in_dim(x, part.q0, part.q1, axis=axis + 1)
    return x.reshape(shape[:axis] + (-1,) + shape[axis + 1:])


def _join_rows(cfg: TileConfig, parts: Sequence[Array], axis: int = 1) -> Array:
    """Inverse of `_part_rows` for the consecutive row ranges of a tile's parts."""
    G, shape = cfg.groups, parts[0].shape
    rows = [x.reshape(shape[:axis] + (G, -1) + shape[axis + 1:]) for x in parts]
    return jnp.concatenate(rows, axis=axis + 1).reshape(shape[:axis] + (-1,) + shape[axis + 1:])


def _rows(cfg: TileConfig, x: Array) -> Array:
    """[B|1, K|1, G|1, bq, bk] -> [R, G * bq, bk], the tiles' layout."""
    B, K, G = cfg.batch, cfg.kv_heads, cfg.groups
    x = jnp.broadcast_to(x, (B, K, G) + x.shape[-2:])
    return x.reshape(B * K, G * x.shape[-2], x.shape[-1])


def _tile_mask(cfg: TileConfig, blocks: MaskBlocks, i, j, part: _Part) -> Array:
    """The [B|1, K|1, G|1, q1 - q0, k1 - k0] bool mask of `part` of tile (i, j)."""
    dense = None
    if blocks.dense is not None:
        d = blocks.dense
        dense = d[i if d.shape[0] > 1 else 0, j if d.shape[1] > 1 else 0]
    tile = AttentionMask(
        q_positions=blocks.q_pos[i],
        kv_positions=blocks.kv_pos[j],
        q_segment_ids=blocks.q_seg[i] if cfg.segments else None,
        kv_segment_ids=blocks.kv_seg[j] if cfg.segments else None,
        dense=dense,
        causal=cfg.causal,
        window=cfg.window,
    ).block(slice(part.q0, part.q1), slice(part.k0, part.k1))
    b, n, tq, tk = tile.shape
    return tile.reshape(b, cfg.kv_heads, cfg.groups, tq, tk) if n > 1 else tile[:, :, None]


def _tile_distance(blocks: MaskBlocks, i, j, part: _Part) -> Array:
    """|q_pos - kv_pos| of `part` of tile (i, j): [B|1, 1, 1, q1 - q0, k1 - k0] float32."""
    q_pos = blocks.q_pos[i][:, part.q0:part.q1]
    delta = q_pos[:, :, None] - blocks.kv_pos[j][:, None, part.k0:part.k1]
    return jnp.abs(delta).astype(jnp.float32)[:, None, None]


def _alibi_bias(cfg: TileConfig, slopes: Array, blocks: MaskBlocks, i, j, part: _Part) -> Array:
    """slope * |q_pos - kv_pos| of `part` of tile (i, j): [R, G * (q1 - q0), k1 - k0]."""
    return _rows(cfg, slopes[None, :, :, None, None] * _tile_distance(blocks, i, j, part))


def _tile_scores(cfg, q_i, k_t, slopes, blocks, i, j, part):
    """(ALiBi-biased) float32 scores [R, G * (q1 - q0), k1 - k0] of pre-scaled queries.

    q_i holds `part`'s rows and k_t its keys, transposed ([R, H, k1 - k0]) as
    the GEMM kernels read them.
    """
    s = jnp.einsum("rqh,rhs->rqs", q_i, k_t, preferred_element_type=jnp.float32)
    if slopes is not None:
        s = s - _alibi_bias(cfg, slopes, blocks, i, j, part)
    return s


def _tile_keep(cfg: TileConfig, rng, i, j) -> Array | None:
    """Dropout keep bits of tile (i, j), [B, K, G, bq, bk]; None without dropout.

    A pure function of (rng, i, j), drawn for the whole tile once per step, so
    the bits depend neither on the layout nor on how the tile is split.
    """
    if rng is None:
        return None
    tile_rng = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    shape = (cfg.batch, cfg.kv_heads, cfg.groups, cfg.block_q, cfg.block_kv)
    return keep_mask(tile_rng, cfg.dropout_rate, shape)


def _part_keep(cfg: TileConfig, keep: Array | None, part: _Part) -> Array | None:
    """`part`'s slice of a tile's keep bits, [R, G * (q1 - q0), k1 - k0] (None passes through)."""
    if keep is None:
        return None
    return _rows(cfg, keep[..., part.q0:part.q1, part.k0:part.k1])


def _dropped(cfg: TileConfig, x: Array, keep: Array | None) -> Array:
    if keep is None:
        return x
    return jnp.where(keep, x / keep_probability(cfg.dropout_rate), 0.0)


def tile_classes(cfg: TileConfig, blocks: MaskBlocks) -> Array | None:
    """[nq, nk] int32 class of every tile, or None when nothing is masked.

    Decided from each tile's least and greatest position and segment id (and
    the dense mask's tile, if any), so it costs O(nq * nk) and no tile's mask
    is evaluated. The class is conservative: a tile called PARTIAL, CORNER or
    NESTED may be wholly visible or hidden (it then evaluates its mask
    exactly), but HIDDEN, VISIBLE and the corners a CORNER or NESTED tile
    skips are certain. Computed once per call; the backward pass reuses the
    forward's.
    """
    if not cfg.has_mask:
        return None
    q = _Extent(blocks.q_pos, blocks.q_seg, rows=True)
    kv = _Extent(blocks.kv_pos, blocks.kv_seg, rows=False)
    hidden, visible = _hidden_visible(cfg, q, kv, blocks.dense)
    classes = jnp.where(visible, VISIBLE, jnp.where(hidden, HIDDEN, PARTIAL))
    depth = _corner_depth(cfg)
    if depth == 0:
        return classes
    bq, bk = cfg.block_q, cfg.block_kv
    # The first half of queries against the second half of keys.
    corner = (classes == PARTIAL) & _corner_hidden(cfg, blocks, bq // 2, bk // 2, bk)
    classes = jnp.where(corner, CORNER, classes)
    if depth == 1:
        return classes
    # And the first quarter of queries against the second quarter of keys.
    nested = corner & _corner_hidden(cfg, blocks, bq // 4, bk // 4, bk // 2)
    return jnp.where(nested, NESTED, classes)


def _corner_hidden(cfg: TileConfig, blocks: MaskBlocks, q1: int, k0: int, k1: int) -> Array:
    """[nq, nk] bool: every tile's queries [0, q1) certainly see none of its keys [k0, k1)."""
    q = _Extent(blocks.q_pos[..., :q1], blocks.q_seg[..., :q1], rows=True)
    kv = _Extent(blocks.kv_pos[..., k0:k1], blocks.kv_seg[..., k0:k1], rows=False)
    dense = blocks.dense
    if dense is not None:
        dense = dense[..., :q1, :] if dense.shape[4] > 1 else dense
        dense = dense[..., k0:k1] if dense.shape[5] > 1 else dense
    return _hidden_visible(cfg, q, kv, dense)[0]


def _hidden_visible(cfg: TileConfig, q: _Extent, kv: _Extent, dense: Array | None):
    """[nq, nk] bool: tiles certainly hidden and certainly visible for every batch row."""
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
    if dense is not None:
        # [nq|1, nk|1, B|1, N|1, bq|1, bk|1] -> [nq|1, nk|1, B|1]
        dense = dense.reshape(dense.shape[:3] + (-1,))
        hidden |= ~dense.any(-1)
        visible &= dense.all(-1)
    # A tile is hidden (visible) only if it is so for every batch row.
    return hidden.all(-1), visible.all(-1)


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
    """Per outer tile, the inner tiles to visit, grouped by class.

    order: [n_outer, n_inner] inner indices, VISIBLE first, then PARTIAL, then
    CORNER, then NESTED, then HIDDEN (never visited); counts: the classes
    visited, each with its [n_outer] count (CORNER and NESTED only where tiles
    can be split so).
    """

    order: Array
    counts: tuple[tuple[int, Array], ...]


# The order in which an outer tile visits its inner tiles' classes.
_VISIT = (VISIBLE, PARTIAL, CORNER, NESTED, HIDDEN)


def _tile_order(cfg: TileConfig, classes: Array | None, inner_axis: int) -> _Order | None:
    if classes is None:
        return None
    rank = jnp.zeros_like(classes)
    for r, kind in enumerate(_VISIT):
        rank = jnp.where(classes == kind, r, rank)
    rank = rank if inner_axis == 1 else rank.T
    order = jnp.argsort(rank, axis=1, stable=True).astype(jnp.int32)
    kinds = _VISIT[:2 + _corner_depth(cfg)]
    return _Order(order, tuple((kind, (rank == _VISIT.index(kind)).sum(1)) for kind in kinds))


def _over_tiles(order: _Order | None, outer, n_inner: int, step, carry):
    """Folds `step(inner, kind, carry)` over the visible inner tiles of `outer`.

    One loop per class, with no conditional in any: the wholly visible tiles
    unmasked, then the tiles the mask cuts through, masked, then the cut tiles
    with a hidden corner, in two parts, then those with nested hidden corners,
    in three. Hidden tiles (the future under a causal mask, other windows or
    segments) are never visited.
    """
    if order is None:
        return lax.fori_loop(0, n_inner, lambda t, c: step(t, VISIBLE, c), carry)
    row, start = order.order[outer], 0
    for kind, count in order.counts:
        stop = start + count[outer]
        carry = lax.fori_loop(start, stop, lambda t, c, kind=kind: step(row[t], kind, c), carry)
        start = stop
    return carry


def single_tile(cfg, q, k, v, slopes, blocks, rng):
    """`flash` when the whole problem is one tile: plain softmax, differentiated by autodiff.

    One tile has no memory to save, so the backward pass keeps the weights
    instead of recomputing the scores (one matmul fewer, no online rescaling).
    Same inputs, mask, dropout bits (tile (0, 0)) and outputs as `flash`;
    rows that see no key get zero output.
    """
    full = _full(cfg)
    s = _tile_scores(cfg, q[0], jnp.swapaxes(k[0], -1, -2), slopes, blocks, 0, 0, full)
    mask = _rows(cfg, _tile_mask(cfg, blocks, 0, 0, full)) if cfg.has_mask else None
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    # The max only keeps exp in range; softmax does not depend on it.
    p = jnp.exp(s - lax.stop_gradient(s.max(-1, keepdims=True)))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)  # rows that see nothing: exp(0) == 1 everywhere
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    keep = _part_keep(cfg, _tile_keep(cfg, rng, 0, 0), full)
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
    order = _tile_order(cfg, classes, inner_axis=1)

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

    def step(self, i, j, kind, carry):
        """The online-softmax update of (max, sum, acc) with key tile j of class `kind`."""
        cfg, keep = self.cfg, _tile_keep(self.cfg, self.rng, i, j)
        if kind not in _SPLIT:
            return self._update(i, j, _full(cfg), kind == PARTIAL, keep, carry)
        parts = [self._update(i, j, part, True, keep,
                              tuple(_part_rows(cfg, c, part) for c in carry))
                 for part in _corner_parts(cfg, kind)]
        return tuple(_join_rows(cfg, rows) for rows in zip(*parts, strict=True))

    def _update(self, i, j, part, masked, keep, carry):
        """One online-softmax update of `part`'s query rows with its keys of tile j.

        `keep` holds the whole tile's dropout bits (or None); the part slices its own.
        """
        m, total, acc = carry
        cfg, v_j = self.cfg, self.v[j][:, part.k0:part.k1]
        q_i, k_t = _part_rows(cfg, self.q_i, part), self.k_t[j][..., part.k0:part.k1]
        s = _tile_scores(cfg, q_i, k_t, self.slopes, self.blocks, i, j, part)
        if masked:
            # The mask enters the max and the exponential instead of rewriting
            # s, so no masked copy of the tile is written between them. Hidden
            # entries (and rows that see nothing yet, m_new == NEG_INF) may
            # overflow exp to inf; the select discards them.
            mask = _rows(cfg, _tile_mask(cfg, self.blocks, i, j, part))
            m_new = jnp.maximum(m, jnp.where(mask, s, NEG_INF).max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        else:
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = _dropped(cfg, p, _part_keep(cfg, keep, part)).astype(v_j.dtype)
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
    order = _tile_order(cfg, classes, inner_axis=0)

    def key_tile(dq, j):
        dk0 = jnp.zeros(k.shape[1:2] + k.shape[3:] + k.shape[2:3], jnp.float32)
        dv0 = jnp.zeros(v.shape[1:2] + v.shape[3:] + v.shape[2:3], jnp.float32)
        dsl0 = jnp.zeros((cfg.kv_heads, cfg.groups), jnp.float32)
        tile = _TileGrad(cfg, queries, k[j], k_t[j], v_t[j], slopes, blocks, rng)

        def query_tile(i, kind, carry):
            return tile.step(i, j, kind, carry)

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

    def step(self, i, j, kind, carry):
        """Adds tile (i, j)'s contributions (of class `kind`) to (dq, dk_j^T, dv_j^T, dslopes)."""
        dq, dk_t, dv_t, dsl = carry
        cfg, keep = self.cfg, _tile_keep(self.cfg, self.rng, i, j)
        if kind not in _SPLIT:
            g = self._grads(i, j, _full(cfg), kind == PARTIAL, keep)
            return dq.at[i].add(g.dq), dk_t + g.dk_t, dv_t + g.dv_t, dsl + g.dsl
        dqs = []
        for part in _corner_parts(cfg, kind):
            g = self._grads(i, j, part, True, keep)
            dk_t, dv_t = _add_keys(cfg, dk_t, g.dk_t, part), _add_keys(cfg, dv_t, g.dv_t, part)
            dqs.append(g.dq)
            dsl = dsl + g.dsl
        return dq.at[i].add(_join_rows(cfg, dqs)), dk_t, dv_t, dsl

    def _grads(self, i, j, part, masked, keep) -> _Grads:
        """The gradients of `part` of tile (i, j): dq of its rows, dk^T and dv^T of its keys.

        `keep` holds the whole tile's dropout bits (or None); the part slices its own.
        """
        cfg, qs, f32 = self.cfg, self.queries, jnp.float32
        k0, k1 = part.k0, part.k1
        q, q_t = _part_rows(cfg, qs.q[i], part), _part_rows(cfg, qs.q_t[i], part, axis=-1)
        do, do_t = _part_rows(cfg, qs.do[i], part), _part_rows(cfg, qs.do_t[i], part, axis=-1)
        lse, delta = _part_rows(cfg, qs.lse[i], part), _part_rows(cfg, qs.delta[i], part)
        s = _tile_scores(cfg, q, self.k_t[..., k0:k1], self.slopes, self.blocks, i, j, part)
        p = jnp.exp(s - lse[..., None])
        if masked:
            p = jnp.where(_rows(cfg, _tile_mask(cfg, self.blocks, i, j, part)), p, 0.0)
        keep = _part_keep(cfg, keep, part)
        pd = _dropped(cfg, p, keep).astype(do_t.dtype)
        dv_t = jnp.einsum("rhq,rqs->rhs", do_t, pd, preferred_element_type=f32)
        dp = jnp.einsum("rqh,rhs->rqs", do, self.v_t[..., k0:k1], preferred_element_type=f32)
        ds = p * (_dropped(cfg, dp, keep) - delta[..., None])
        dq = jnp.einsum("rqs,rsh->rqh", ds, self.k_j[:, k0:k1], preferred_element_type=f32)
        dk_t = jnp.einsum("rhq,rqs->rhs", q_t, ds, preferred_element_type=f32)
        dsl = jnp.zeros((), f32)
        if self.slopes is not None:
            ds5 = ds.reshape(cfg.batch, cfg.kv_heads, cfg.groups, part.q1 - part.q0, k1 - k0)
            dsl = -jnp.sum(ds5 * _tile_distance(self.blocks, i, j, part), axis=(0, 3, 4))
        return _Grads(dq, dk_t, dv_t, dsl)


def _add_keys(cfg: TileConfig, acc: Array, grad: Array, part: _Part) -> Array:
    """acc [..., bk] plus the gradient of `part`, which saw the tile's keys [0, k1)."""
    if part.k1 == cfg.block_kv:
        return acc + grad
    return acc.at[..., :part.k1].add(grad)


class _Grads(NamedTuple):
    """One tile part's gradient contributions."""

    dq: Array  # [R, G * (q1 - q0), H]
    dk_t: Array  # [R, H, k1 - k0]
    dv_t: Array  # [R, Hv, k1 - k0]
    dsl: Array  # [K, G] or 0.0 without ALiBi


flash.defvjp(_flash_fwd, _flash_bwd)

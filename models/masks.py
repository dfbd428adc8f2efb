"""Attention masks: boolean, True = may attend.

Two forms, both accepted by `dot_product_attention`:

* dense boolean arrays broadcastable to [B, N, T, S], built with
  `padding_mask`, `causal_mask`, `segment_mask` and `combine_masks`;
* `AttentionMask`, a structured description (segment ids, positions,
  causality, optional dense extra). Models build it once at the top from the
  batch and pass it down; the reference implementation materialises it with
  `.dense()`, memory-efficient implementations evaluate it block by block and
  never build the [T, S] matrix.

Padding is expressed as segment id 0: a token attends only to tokens of its own
non-zero segment, which covers both padding and packed sequences.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

Array = Any

# One large negative value, used with jnp.where (never added), so that a fully
# masked row stays finite: softmax of equal values is uniform, not NaN.
NEG_INF = float(jnp.finfo(jnp.float32).min)


def padding_mask(q_ids: Array, kv_ids: Array | None = None, pad_id: int = 0) -> Array:
    """Mask of non-padding query/key pairs.

    Args:
      q_ids: [B, T] token ids of the queries.
      kv_ids: [B, S] token ids of the keys (defaults to `q_ids`).
      pad_id: the padding id.

    Returns:
      [B, 1, T, S] bool.
    """
    kv_ids = q_ids if kv_ids is None else kv_ids
    q_ok = q_ids != pad_id
    kv_ok = kv_ids != pad_id
    return (q_ok[:, None, :, None] & kv_ok[:, None, None, :]).astype(bool)


def causal_mask(q_len: int, kv_len: int | None = None) -> Array:
    """Lower-triangular mask: query t sees keys s <= t (aligned at the start).

    Returns:
      [1, 1, T, S] bool.
    """
    kv_len = q_len if kv_len is None else kv_len
    return causal_mask_from_positions(jnp.arange(q_len)[None], jnp.arange(kv_len)[None])


def causal_mask_from_positions(q_positions: Array, kv_positions: Array) -> Array:
    """Causal mask from explicit positions ([B, T] and [B, S]) -> [B, 1, T, S]."""
    return kv_positions[:, None, None, :] <= q_positions[:, None, :, None]


def segment_mask(q_segment_ids: Array, kv_segment_ids: Array | None = None) -> Array:
    """Tokens attend only within their own segment; segment 0 is padding.

    Args:
      q_segment_ids: [B, T] int, 1, 2, ... per packed sequence, 0 on padding.
      kv_segment_ids: [B, S] int (defaults to `q_segment_ids`).

    Returns:
      [B, 1, T, S] bool.
    """
    kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    return same & (kv_segment_ids[:, None, None, :] != 0) & (q_segment_ids[:, None, :, None] != 0)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the given masks, ignoring None; None if all are None."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0].astype(bool)
    for m in present[1:]:
        out = out & m.astype(bool)
    return out


@struct.dataclass
class AttentionMask:
    """Structured mask, evaluated lazily (densely or block by block).

    Attributes:
      q_positions: [B|1, T] int positions of the queries (causality, ALiBi).
      kv_positions: [B|1, S] int positions of the keys.
      q_segment_ids: optional [B, T] int, 0 = padding.
      kv_segment_ids: optional [B, S] int, 0 = padding.
      dense: optional extra bool mask broadcastable to [B, N, T, S].
      causal: whether key position must be <= query position.
      window: optional sliding window w; with causal, a query at p sees keys
        in (p - w, p]; without, keys with |p - q| <= w // 2.
    """

    q_positions: Array
    kv_positions: Array
    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    dense: Array | None = None
    causal: bool = struct.field(pytree_node=False, default=False)
    window: int | None = struct.field(pytree_node=False, default=None)

    def block(self, q_slice: slice | None = None, kv_slice: slice | None = None) -> Array:
        """Materialises the [B, 1|N, Tq, Sk] bool mask of a sub-block."""
        qs = q_slice or slice(None)
        ks = kv_slice or slice(None)
        q_pos = self.q_positions[:, qs]
        kv_pos = self.kv_positions[:, ks]
        parts = [jnp.ones((1, 1, q_pos.shape[1], kv_pos.shape[1]), bool)]
        if self.q_segment_ids is not None or self.kv_segment_ids is not None:
            q_seg = _segments(self.q_segment_ids, qs, q_pos)
            kv_seg = _segments(self.kv_segment_ids, ks, kv_pos)
            parts.append(segment_mask(q_seg, kv_seg))
        delta = q_pos[:, None, :, None] - kv_pos[:, None, None, :]
        if self.causal:
            parts.append(delta >= 0)
            if self.window is not None:
                parts.append(delta < self.window)
        elif self.window is not None:
            parts.append(jnp.abs(delta) <= self.window // 2)
        if self.dense is not None:
            # Size-1 axes broadcast: slice only the axes that have T or S entries.
            dense = self.dense
            dense = dense[:, :, qs] if dense.shape[2] > 1 else dense
            dense = dense[:, :, :, ks] if dense.shape[3] > 1 else dense
            parts.append(dense)
        return combine_masks(*parts)

    def dense_mask(self) -> Array:
        """The full [B, 1|N, T, S] bool mask."""
        return self.block()


def _segments(segment_ids: Array | None, sl: slice, sliced_positions: Array) -> Array:
    """The sliced segment ids, or ones (all one segment) shaped like the positions."""
    if segment_ids is not None:
        return segment_ids[:, sl]
    return jnp.ones(sliced_positions.shape, jnp.int32)


def make_attention_mask(
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None = None,
    *,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
    causal: bool = False,
    window: int | None = None,
) -> AttentionMask:
    """Builds an AttentionMask, defaulting positions to 0..L-1.

    Lengths come from the segment ids or positions when given, else from
    `q_len` / `kv_len`.
    """
    q_positions = _default_positions(q_positions, q_segment_ids, q_len, "q")
    if kv_positions is None and kv_segment_ids is None and kv_len is None:
        kv_positions, kv_segment_ids = q_positions, q_segment_ids
    kv_positions = _default_positions(kv_positions, kv_segment_ids, kv_len, "kv")
    return AttentionMask(
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        window=window,
    )


def _default_positions(positions, segment_ids, length, name):
    if positions is not None:
        return positions
    if segment_ids is not None:
        length = segment_ids.shape[-1]
    if length is None:
        raise ValueError(
            f"make_attention_mask: need {name}_positions, {name}_segment_ids or {name}_len")
    return jnp.arange(length, dtype=jnp.int32)[None]

"""Positional information: sinusoidal, learned, RoPE, ALiBi (and none).

Sinusoidal and learned encodings are added to the embeddings; RoPE rotates
queries and keys inside attention; ALiBi adds a per-head linear distance bias
to the scores. All take explicit positions so that packed sequences restart at
0 and incremental decoding continues at the right offset.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from transformer_zoo.models import axes

Array = Any


def sinusoidal_encoding(positions: Array, features: int, max_timescale: float = 10000.0, *,
                        concat: bool = False) -> Array:
    """The paper's encoding, PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...).

    Args:
      positions: [B, T] int positions.
      features: D (even).
      max_timescale: the 10000 of the paper.
      concat: the tensor2tensor / Marian layout instead: the D/2 sines in the
        first half, the D/2 cosines in the second (same frequencies).

    Returns:
      [B, T, D] float32, sines on even and cosines on odd dimensions (or in halves).
    """
    if features % 2:
        raise ValueError(f"sinusoidal encoding needs an even d_model, got {features}")
    i = jnp.arange(features // 2, dtype=jnp.float32)
    inv_freq = jnp.exp(-math.log(max_timescale) * 2.0 * i / features)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    if concat:
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], -1)


class LearnedPositionalEmbedding(nn.Module):
    """A learned absolute position table of `max_length` rows.

    Attributes:
      max_length: number of positions in the table.
      features: D.
      param_dtype: table dtype.
    """

    max_length: int
    features: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, positions: Array) -> Array:
        """positions [B, T] -> [B, T, D] float32."""
        if positions.shape[-1] > self.max_length:
            raise ValueError(
                f"sequence length {positions.shape[-1]} exceeds the learned position table "
                f"(max_length={self.max_length})"
            )
        table = self.param(
            "pos_embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (axes.LENGTH, axes.EMBED)),
            (self.max_length, self.features),
            self.param_dtype,
        )
        return jnp.take(table, positions, axis=0).astype(jnp.float32)


def rope_frequencies(head_dim: int, base: float = 10000.0) -> Array:
    """Inverse frequencies theta_i = base^(-2i/H) for i < H/2."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x: Array, positions: Array, base: float = 10000.0) -> Array:
    """Rotates each (x_i, x_{i+H/2}) pair by angle pos * theta_i (half-split layout).

    Args:
      x: [B, T, N, H] queries or keys.
      positions: [B|1, T] int positions.
      base: the RoPE base.

    Returns:
      [B, T, N, H], same dtype as x. q.k of rotated vectors depends only on
      the offset between their positions.
    """
    inv_freq = rope_frequencies(x.shape[-1], base)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's head slopes: a geometric sequence starting at 2^(-8/n).

    For n not a power of two, the slopes of the closest smaller power of two are
    followed by every other slope of twice that many heads (Press et al. 2022).

    Returns:
      [N] float32 numpy array.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)

"""Token embedding scaled by sqrt(d_model), with attend() for tied logits."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import axes, streamed
from models.gradient_barrier import stored_transpose

Array = Any


class Embed(nn.Module):
    """Token embedding; `attend` reuses the table as the pre-softmax projection.

    The table is initialised with std D^-0.5 so that, after the paper's
    multiplication by sqrt(D), embeddings have unit scale like the positional
    encodings they are added to.

    Attributes:
      num_embeddings: V.
      features: D.
      scale_by_sqrt_dim: multiply looked-up vectors by sqrt(D) (the paper).
      dtype: compute dtype of the returned embeddings.
      param_dtype: table dtype.
    """

    num_embeddings: int
    features: int
    scale_by_sqrt_dim: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(
                nn.initializers.normal(self.features**-0.5), (axes.VOCAB, axes.EMBED)
            ),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, ids: Array) -> Array:
        """ids [B, T] int -> [B, T, D] in `dtype`."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"Embed expects integer token ids, got dtype {ids.dtype}")
        x = jnp.take(self.embedding, ids, axis=0).astype(self.dtype)
        if self.scale_by_sqrt_dim:
            x = x * jnp.asarray(math.sqrt(self.features), self.dtype)
        return x

    def attend(self, x: Array) -> Array:
        """Tied output projection: x [B, T, D] -> logits [B, T, V] float32."""
        return tied_logits(x.astype(jnp.float32), self.embedding.astype(jnp.float32))


@jax.custom_vjp
def tied_logits(x: Array, table: Array) -> Array:
    """x [..., D] against the embedding table [V, D] -> logits [..., V].

    The gradient is autodiff's, computed in an order that suits the largest
    array of a training step, the logits gradient g [..., V]: the table's
    gradient is formed as x^T g [D, V] and transposed (V * D elements), where
    the direct g^T x makes XLA:CPU write a transposed copy of g (V * tokens
    elements, 4x more at 1k tokens per batch) first, or run a slower Eigen dot.

    With few rows on CPU (decoding steps) the logits are a streamed product
    (models/streamed.py): the [V, D] table is already the layout it reads.
    """
    if streamed.enabled() and streamed.fits(math.prod(x.shape[:-1])):  # a decoding step
        return streamed.streamed_matmul(x, table)
    return jnp.einsum("...d,vd->...v", x, table)


def _tied_logits_fwd(x, table):
    return tied_logits(x, table), (x, table)


def _tied_logits_bwd(residuals, g):
    x, table = residuals
    dx = jnp.einsum("...v,vd->...d", g, table)
    # Both transposes are stored (gradient_barrier.stored_transpose), so the
    # [D, V] product stays a plain dot, a YNNPACK one on CPU; a bare final .T
    # would be folded into the dot, swapping it back to g^T x (Eigen).
    x_t = stored_transpose(x.reshape(-1, x.shape[-1]))
    return dx, stored_transpose(x_t @ g.reshape(-1, g.shape[-1]))


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)

"""Token embedding scaled by sqrt(d_model), with attend() for tied logits."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from models import axes

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
        return jnp.einsum(
            "btd,vd->btv", x.astype(jnp.float32), self.embedding.astype(jnp.float32)
        )

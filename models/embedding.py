"""Token embedding scaled by sqrt(d_model), with attend() for tied logits."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from transformer_zoo.models import axes, cpu_kernels
from transformer_zoo.models.variants import Kernels, parse

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
      kernels: PORTABLE (plain JAX) or CPU (models/cpu_kernels.py) for `attend`.
      dtype: compute dtype of the returned embeddings.
      param_dtype: table dtype.
    """

    num_embeddings: int
    features: int
    scale_by_sqrt_dim: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernels: Kernels = Kernels.PORTABLE

    def __post_init__(self):
        parse(Kernels, self.kernels, "Embed.kernels")
        super().__post_init__()

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

    def attend(self, x: Array, *, decode: bool = False) -> Array:
        """Tied output projection: x [B, T, D] -> logits [B, T, V] float32.

        With kernels=CPU, a decoding step (decode=True, few rows) streams the
        table, which is already the [V, D] layout that product reads, and
        training uses the CPU layer's gradient order (models/cpu_kernels.py).
        """
        x, table = x.astype(jnp.float32), self.embedding.astype(jnp.float32)
        if self.kernels != Kernels.CPU:
            return jnp.einsum("...d,vd->...v", x, table)
        if decode and cpu_kernels.fits(math.prod(x.shape[:-1])):
            return cpu_kernels.streamed_matmul(x, table)
        return cpu_kernels.tied_logits(x, table)

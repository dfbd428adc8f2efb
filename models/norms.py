"""LayerNorm and RMSNorm, computed in float32 whatever the compute dtype."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_zoo.models import axes
from transformer_zoo.models.variants import Norm, parse

Array = Any


class LayerNorm(nn.Module):
    """y = gamma * (x - mean) / sqrt(var + eps) + beta over the last axis."""

    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * _vector(self, "scale", nn.initializers.ones, x.shape[-1])
        if self.use_bias:
            y = y + _vector(self, "bias", nn.initializers.zeros, x.shape[-1])
        return y.astype(self.dtype)


class RMSNorm(nn.Module):
    """y = gamma * x / sqrt(mean(x^2) + eps) (no centering, no bias)."""

    epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.epsilon)
        return (y * _vector(self, "scale", nn.initializers.ones, x.shape[-1])).astype(self.dtype)


def _vector(module: nn.Module, name: str, init, size: int) -> Array:
    param = module.param(
        name, nn.with_logical_partitioning(init, (axes.EMBED,)), (size,), module.param_dtype
    )
    return param.astype(jnp.float32)


NORMS = {Norm.LAYERNORM: LayerNorm, Norm.RMSNORM: RMSNorm}


def make_norm(kind: Norm | str, epsilon: float, dtype, param_dtype,
              name: str | None = None) -> nn.Module:
    """Builds the norm `kind` (a `Norm` or its string; ValueError otherwise)."""
    norm = NORMS[parse(Norm, kind, "norm")]
    return norm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name)

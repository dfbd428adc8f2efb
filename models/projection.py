"""A multi-axis dense layer (the attention and FFN projections)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from transformer_zoo.models import cpu_kernels
from transformer_zoo.models.variants import Kernels, parse

Array = Any


class Projection(nn.Module):
    """A multi-axis dense layer, x [..., *in] @ kernel [*in, *features] + bias.

    Like nn.DenseGeneral (same parameter names, shapes and initial values), but
    the kernel is created in its full shape, so its logical axis names apply
    as declared under a mesh (DenseGeneral flattens it; google/flax#3676).

    Attributes:
      features: output dims, e.g. (N, H), or D for the output projection.
      kernel_axes: logical names of the kernel dims.
      in_dims: how many trailing input dims are contracted.
      use_bias: add a bias of shape `features`.
      streamable: with kernels=CPU, multiply by the caller's transposed kernel
        ("decode_weights" collection, models/cpu_kernels.py) when it is passed
        and the rows are few; False where the caller fuses this projection with
        others that share its input.
      kernels: PORTABLE (a plain dot) or CPU (models/cpu_kernels.py).
      dtype: compute dtype.
      param_dtype: kernel and bias dtype.
    """

    features: int | tuple[int, ...]
    kernel_axes: tuple[str, ...]
    in_dims: int = 1
    use_bias: bool = False
    streamable: bool = True
    kernels: Kernels = Kernels.PORTABLE
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        parse(Kernels, self.kernels, "Projection.kernels")
        super().__post_init__()

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = self.features if isinstance(self.features, tuple) else (self.features,)
        in_shape = x.shape[x.ndim - self.in_dims:]
        fan_in, fan_out = math.prod(in_shape), math.prod(features)

        def init(key, shape, dtype):  # xavier on the flattened matrix, as DenseGeneral
            return nn.initializers.xavier_uniform()(key, (fan_in, fan_out), dtype).reshape(shape)

        kernel = self.param("kernel", nn.with_logical_partitioning(init, self.kernel_axes),
                            (*in_shape, *features), self.param_dtype)
        lead = x.shape[:x.ndim - self.in_dims]
        kernel_t = self._streamed_kernel(math.prod(lead))
        if kernel_t is not None:
            y = cpu_kernels.streamed_projection(x, kernel_t, self.in_dims).astype(self.dtype)
        else:
            # Multiplied as a 2-D matrix: one dot whatever the number of axes.
            matmul = cpu_kernels.dense_matmul if self.kernels == Kernels.CPU else jnp.matmul
            y = matmul(x.astype(self.dtype).reshape(-1, fan_in),
                       kernel.astype(self.dtype).reshape(fan_in, fan_out))
            y = y.reshape(*lead, *features)
        if self.use_bias:
            bias_axes = self.kernel_axes[len(self.kernel_axes) - len(features):]
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                   bias_axes),
                              features, self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y

    def _streamed_kernel(self, rows: int) -> Array | None:
        """The caller's kernel.T for a streamed product of `rows` rows, or None."""
        if self.kernels != Kernels.CPU or not self.streamable or not cpu_kernels.fits(rows):
            return None
        return cpu_kernels.read_decode_weight(self, "kernel_t")

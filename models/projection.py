"""A multi-axis dense layer (the attention and FFN projections)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import streamed
from models.gradient_barrier import stored_transpose

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
      streamable: in decoding steps on CPU, multiply by a transposed copy of
        the kernel (models/streamed.py); False where the caller fuses this
        projection with others that share its input.
    """

    features: int | tuple[int, ...]
    kernel_axes: tuple[str, ...]
    in_dims: int = 1
    use_bias: bool = False
    streamable: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = self.features if isinstance(self.features, tuple) else (self.features,)
        in_shape = x.shape[x.ndim - self.in_dims:]
        fan_in, fan_out = math.prod(in_shape), math.prod(features)

        def init(key, shape, dtype):  # xavier on the flattened matrix, as DenseGeneral
            return nn.initializers.xavier_uniform()(key, (fan_in, fan_out), dtype).reshape(shape)

        kernel = self.param("kernel", nn.with_logical_partitioning(init, self.kernel_axes),
                            (*in_shape, *features), self.param_dtype)
        kernel_t = streamed.decode_weight(
            self, "kernel_t", lambda: kernel.reshape(fan_in, fan_out).T
        ) if self.streamable else None
        lead = x.shape[:x.ndim - self.in_dims]
        if kernel_t is not None and streamed.fits(math.prod(lead)):
            y = streamed.streamed_matmul(x.reshape(*lead, fan_in), kernel_t)
            y = y.astype(self.dtype).reshape(*lead, *features)
        else:
            y = dense_matmul(x.astype(self.dtype).reshape(-1, fan_in),
                             kernel.astype(self.dtype).reshape(fan_in, fan_out))
            y = y.reshape(*lead, *features)
        if self.use_bias:
            bias_axes = self.kernel_axes[len(self.kernel_axes) - len(features):]
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                   bias_axes),
                              features, self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


@jax.custom_vjp
def dense_matmul(x: Array, w: Array) -> Array:
    """x [M, K] @ w [K, N]; the gradient is autodiff's, w's formed as a plain dot.

    The kernel gradient x^T g is computed from a stored x^T [K, M]
    (`gradient_barrier.stored_transpose`), so on CPU it runs as a YNNPACK dot
    instead of Eigen's transposed-operand dot: 1.1-1.5x faster at these shapes,
    the copy included. With the tied table's gradient done alike, the issue-9 training step
    ran 1.19-1.21x faster, losses equal to 1e-5 (benchmarks/README.md, session 5).
    """
    return x @ w


def _dense_matmul_fwd(x, w):
    return x @ w, (x, w)


def _dense_matmul_bwd(residuals, g):
    x, w = residuals
    return g @ w.T, stored_transpose(x) @ g


dense_matmul.defvjp(_dense_matmul_fwd, _dense_matmul_bwd)

"""Position-wise feed-forward network: FFN(x) = act(x W1 + b1) W2 + b2."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from transformer_zoo.models import axes
from transformer_zoo.models.dropout import Dropout
from transformer_zoo.models.projection import Projection
from transformer_zoo.models.variants import FfnActivation, Kernels, parse

Array = Any

# Gated variants (Shazeer 2020) multiply the activation by a second projection.
ACTIVATIONS = {
    FfnActivation.RELU: (nn.relu, False),
    FfnActivation.GELU: (nn.gelu, False),
    FfnActivation.GELU_EXACT: (functools.partial(nn.gelu, approximate=False), False),
    FfnActivation.SILU: (nn.silu, False),
    FfnActivation.SWIGLU: (nn.silu, True),
    FfnActivation.GEGLU: (nn.gelu, True),
}


def dense(features, in_axis: str, out_axis: str, *, use_bias: bool, dtype, param_dtype, name,
          streamable: bool = True, kernels: Kernels = Kernels.PORTABLE):
    """A Dense layer whose kernel and bias carry logical axis names.

    nn.Dense's parameters (names, shapes, xavier-uniform kernel, zero bias),
    through `Projection` (which, with kernels=CPU, streams decoding steps).
    """
    return Projection(features, (in_axis, out_axis), use_bias=use_bias, streamable=streamable,
                      kernels=kernels, dtype=dtype, param_dtype=param_dtype, name=name)


class FeedForward(nn.Module):
    """The paper's FFN (ReLU) and its GELU / SiLU / SwiGLU / GeGLU variants.

    Attributes:
      d_ff: hidden width F.
      activation: an `FfnActivation` (or its string).
      dropout_rate: dropout on the hidden activations.
      use_bias: biases on both projections.
      kernels: PORTABLE or CPU (models/cpu_kernels.py) for the projections.
    """

    d_ff: int
    activation: FfnActivation = FfnActivation.RELU
    dropout_rate: float = 0.0
    use_bias: bool = True
    kernels: Kernels = Kernels.PORTABLE
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        parse(FfnActivation, self.activation, "FeedForward.activation")
        parse(Kernels, self.kernels, "FeedForward.kernels")
        super().__post_init__()

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        """x [B, T, D] -> [B, T, D]."""
        act, gated = ACTIVATIONS[FfnActivation(self.activation)]
        kw = dict(use_bias=self.use_bias, kernels=self.kernels, dtype=self.dtype,
                  param_dtype=self.param_dtype)
        # Two streamed products of one x would share its broadcast, which XLA:CPU
        # stores (models/cpu_kernels.py): gated variants keep the dot for wi.
        h = act(dense(self.d_ff, axes.EMBED, axes.MLP, name="wi", streamable=not gated, **kw)(x))
        if gated:
            h = h * dense(self.d_ff, axes.EMBED, axes.MLP, name="wi_gate", streamable=False,
                          **kw)(x)
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, axes.MLP))
        h = Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return dense(x.shape[-1], axes.MLP, axes.EMBED, name="wo", **kw)(h)

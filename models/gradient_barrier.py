"""An identity whose gradient XLA:CPU stores instead of recomputing.

In a pre-norm stack the residual stream's gradient is a chain of adds, one
per sublayer. XLA:CPU fuses such cheap producers into every consumer, and each
fused copy includes its own producers, so the chain is recomputed in every
consumer of every layer (the char LM's backward had fusions with 32-41 matmul
outputs as inputs). An optimization barrier does not stop this on CPU (it is
expanded before fusion), but a conditional does: fusion never crosses its
boundary. `stored_gradient` is the identity forward; backward it passes the
gradient through a conditional on a runtime predicate, so the gradient is
materialised once per residual. Only on the CPU backend: GPU conditionals read
their predicate on the host, which would synchronise every layer.

The char LM step runs 1.15-1.17x faster with losses bitwise equal
(benchmarks/README.md); post-norm stacks showed no change and do not use it.

`stored_transpose` uses the same conditional for a weight gradient's layout.
A dense layer's kernel gradient x^T g contracts the first dimension of both
operands; XLA:CPU folds any transpose into the dot, and its YNNPACK fusion only
takes a left operand that contracts its last dimension, so every such dot ran
in Eigen, at 0.5-0.9x YNNPACK's speed. Behind a conditional the transpose stays a
written [K, M] array and the dot an ordinary one (models/projection.py).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

Array = Any


def enabled() -> bool:
    """Whether `stored_gradient` inserts its conditional (the CPU backend)."""
    return jax.default_backend() == "cpu"


@jax.custom_vjp
def stored_gradient(x: Array) -> Array:
    """Identity; its gradient is materialised once (see the module docstring)."""
    return x


def _fwd(x):
    return x, None


def _behind_conditional(x: Array, f) -> Array:
    """f(x), computed inside a conditional that fusion and folding do not cross."""
    first = x.reshape(-1)[0]
    # True unless the first element is NaN; the branches must differ or XLA merges
    # them and removes the conditional. They agree except for -0.0 elements, and
    # then only when x already holds a NaN.
    return lax.cond(first == first, f, lambda v: f(v) + 0.0, x)


def _bwd(_, g):
    return (_behind_conditional(g, lambda v: v) if enabled() else g,)


stored_gradient.defvjp(_fwd, _bwd)


def stored_transpose(x: Array) -> Array:
    """x [M, K] -> x^T [K, M], written out on CPU where XLA cannot fold it into a dot.

    The values are x.T's (a -0.0 may read +0.0 when x's first element is NaN).
    """
    if x.ndim != 2:
        raise ValueError(f"stored_transpose: x must be [M, K], got shape {x.shape}")
    return _behind_conditional(x, lambda v: v.T) if enabled() else x.T

"""Weight-streaming products for decoding steps on CPU.

A decoding step multiplies a few rows (the batch, or batch x beams) by every
weight matrix once, so its cost is reading the weights. XLA:CPU's matmul
kernels read a [K, N] kernel at 2.5-5 GB/s at M = 8 rows (they pack it for
the GEMM as if it were reused), whereas a multiply + reduce over K against the
kernel stored transposed, [N, K], reads each weight row once, contiguously,
for all M rows: 2-2.7x faster at M = 8 and 1.5-2x at M = 32 on the 2-core
dev machine (benchmarks/README.md, "weight-streaming decoding steps").

The transposed copies live in the "decode_weights" collection, which models/
generate.py creates on CPU in its cache-creating call (`Projection` adds
"kernel_t" when the collection is mutable) and passes to every step; they are
not part of the parameters, so checkpoints and training are unaffected. The
tied output projection needs no copy: the embedding table is already [V, D].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = Any

DECODE_WEIGHTS = "decode_weights"

# Above this many rows the GEMM kernels win (the weights are reused enough).
MAX_ROWS = 32


def enabled() -> bool:
    """Whether decoding steps stream weights: on the CPU backend only (GPUs and
    TPUs have matrix-vector kernels that already read weights at full speed)."""
    return jax.default_backend() == "cpu"


def fits(rows: int) -> bool:
    """Whether `rows` input rows are few enough for the streamed product."""
    return rows <= MAX_ROWS


def decode_weight(module, name: str, make: Callable[[], Array]) -> Array | None:
    """`module`'s streamed-layout weight `name` ([N, K]), or None outside decoding.

    Created with make() when the collection is mutable (the cache-creating call
    of models/generate.py), read in the steps. Never created in `init`, where
    every collection is mutable: a stored copy would go stale once the
    parameters are trained.
    """
    if module.has_variable(DECODE_WEIGHTS, name):
        return module.get_variable(DECODE_WEIGHTS, name)
    if module.is_mutable_collection(DECODE_WEIGHTS) and not module.is_initializing():
        return module.variable(DECODE_WEIGHTS, name, make).value
    return None


def streamed_matmul(x: Array, w_t: Array) -> Array:
    """x [..., K] @ w_t[N, K]^T -> [..., N] in float32, one contiguous pass over w_t.

    The product is formed as an elementwise multiply reduced over K, which XLA
    fuses into one loop over the rows of w_t (the [N, M, K] product, M the
    leading rows of x, is never stored). Products and sums are float32 for any
    input dtype, as in a dot.
    """
    if x.ndim < 1 or w_t.ndim != 2 or x.shape[-1] != w_t.shape[1]:
        raise ValueError(f"streamed_matmul: x {x.shape} and w_t {w_t.shape} are not "
                         "[..., K] and [N, K]")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    prod = w_t.astype(jnp.float32)[:, None, :] * rows[None, :, :]
    return jnp.sum(prod, axis=-1).T.reshape(*x.shape[:-1], w_t.shape[0])

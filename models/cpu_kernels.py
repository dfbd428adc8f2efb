"""The XLA:CPU layer: everything that exists only to make XLA:CPU fast.

A module takes this path when its `kernels` attribute (ModelConfig.kernels)
is `Kernels.CPU`; the default, `Kernels.PORTABLE`, never touches this file. The
values are the portable path's (tests/models/test_cpu_kernels.py checks every
family with the layer off and on); only speed differs. Each device-specific
choice is made with `lax.platform_dependent`, i.e. from the platform being
compiled for, so with the layer on a program lowered for GPU or TPU (or
exported for them from a CPU host) contains the portable computation and none
of the conditionals below. The layer uses `jax.custom_vjp`, so it supports
reverse-mode autodiff only (no jvp): it is for training and decoding loops.

Training (reverse mode):

* `stored_transpose` / `dense_matmul`: a dense layer's kernel gradient x^T g
  contracts the first dimension of both operands. XLA:CPU folds any transpose
  into the dot, and its YNNPACK fusion only takes a left operand that contracts
  its last dimension, so such dots ran in Eigen at 0.5-0.9x YNNPACK's speed.
  Behind a conditional the transpose stays a written [K, M] array and the dot
  an ordinary one: 1.1-1.5x faster per weight-gradient dot, the copy included.
* `tied_logits`: the tied table's gradient is formed as x^T g [D, V] and then
  transposed, where the direct g^T x makes XLA:CPU write a transposed copy of
  the [tokens, V] logits gradient first (4x more elements at 1k tokens).
* `stored_gradient`: in a pre-norm stack the residual stream's gradient is a
  chain of adds that XLA:CPU fuses into (and recomputes in) every consumer of
  every layer; a conditional materialises it once (char LM step 1.15-1.17x).
  An optimization barrier does not help on CPU: it is expanded before fusion.

Decoding (a few rows against every weight):

* `streamed_matmul`: XLA:CPU's GEMM kernels read a [K, N] kernel at 2.5-5 GB/s
  for M = 8 rows (they pack it as if it were reused); a multiply + reduce over
  K against the kernel stored transposed, [N, K], reads each weight row once
  for all rows: 2-2.7x faster at M = 8, 1.5-2x at M = 32 (MAX_ROWS).
* `decode_weights(params)` builds those transposed kernels from the
  parameters. models/generate.py calls it inside its jitted search and passes
  the result to every step as the "decode_weights" variable collection; the
  modules only read that collection, never create it, so it cannot go stale
  and never appears in a `mutable=True` output.

Measurements: benchmarks/README.md ("Training step", "Decoding").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = Any

DECODE_WEIGHTS = "decode_weights"

# Above this many rows the GEMM kernels win (the weights are reused enough).
MAX_ROWS = 32


def on_cpu(cpu_fn, portable_fn, *args):
    """cpu_fn(*args) when compiling for CPU, else portable_fn(*args).

    Only the chosen branch is lowered (a program for one platform has no
    conditional from this; a multi-platform export switches on the platform).
    """
    return lax.platform_dependent(*args, cpu=cpu_fn, default=portable_fn)


# ------------------------------------------------------------------------------ training


def _behind_conditional(x: Array, f) -> Array:
    """f(x), computed inside a conditional that fusion and folding do not cross."""
    first = x.reshape(-1)[0]
    # True unless the first element is NaN; the branches must differ or XLA merges
    # them and removes the conditional. They agree except for -0.0 elements, and
    # then only when x already holds a NaN.
    return lax.cond(first == first, f, lambda v: f(v) + 0.0, x)


def stored_transpose(x: Array) -> Array:
    """x [M, K] -> x^T [K, M], written out on CPU where XLA would fold it into a dot.

    The values are x.T's (a -0.0 may read +0.0 when x's first element is NaN).
    """
    if x.ndim != 2:
        raise ValueError(f"stored_transpose: x must be [M, K], got shape {x.shape}")
    return on_cpu(lambda v: _behind_conditional(v, lambda u: u.T), lambda v: v.T, x)


@jax.custom_vjp
def stored_gradient(x: Array) -> Array:
    """Identity; on CPU its gradient is materialised once (see the module docstring)."""
    return x


def _stored_gradient_fwd(x):
    return x, None


def _stored_gradient_bwd(_, g):
    return (on_cpu(lambda v: _behind_conditional(v, lambda u: u), lambda v: v, g),)


stored_gradient.defvjp(_stored_gradient_fwd, _stored_gradient_bwd)


@jax.custom_vjp
def dense_matmul(x: Array, w: Array) -> Array:
    """x [M, K] @ w [K, N]; the kernel gradient is a plain dot on a stored x^T."""
    return x @ w


def _dense_matmul_fwd(x, w):
    return x @ w, (x, w)


def _dense_matmul_bwd(residuals, g):
    x, w = residuals
    return g @ w.T, stored_transpose(x) @ g


dense_matmul.defvjp(_dense_matmul_fwd, _dense_matmul_bwd)


@jax.custom_vjp
def tied_logits(x: Array, table: Array) -> Array:
    """x [..., D] against the embedding table [V, D] -> logits [..., V].

    The gradient is autodiff's, the table's formed as (x^T g)^T (see the module
    docstring).
    """
    return jnp.einsum("...d,vd->...v", x, table)


def _tied_logits_fwd(x, table):
    return tied_logits(x, table), (x, table)


def _tied_logits_bwd(residuals, g):
    x, table = residuals
    dx = jnp.einsum("...v,vd->...d", g, table)
    # Both transposes are stored, so the [D, V] product stays a plain dot, a
    # YNNPACK one on CPU; a bare final .T would be folded into the dot, swapping
    # it back to g^T x (Eigen).
    x_t = stored_transpose(x.reshape(-1, x.shape[-1]))
    return dx, stored_transpose(x_t @ g.reshape(-1, g.shape[-1]))


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


# ------------------------------------------------------------------------------ decoding


def fits(rows: int) -> bool:
    """Whether `rows` input rows are few enough for the streamed product."""
    return rows <= MAX_ROWS


def _streamed(x: Array, w_t: Array) -> Array:
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    # Multiply + reduce over K, which XLA fuses into one pass over the rows of
    # w_t (the [N, M, K] product is never stored).
    prod = w_t.astype(jnp.float32)[:, None, :] * rows[None, :, :]
    return jnp.sum(prod, axis=-1).T.reshape(*x.shape[:-1], w_t.shape[0])


def _dot_t(x: Array, w_t: Array) -> Array:
    return jnp.einsum("...k,nk->...n", x, w_t, preferred_element_type=jnp.float32)


def streamed_matmul(x: Array, w_t: Array) -> Array:
    """x [..., K] @ w_t[N, K]^T -> [..., N] float32, one contiguous pass over w_t on CPU.

    Products and sums are float32 for any input dtype, as in a dot; on other
    platforms it is that dot.
    """
    if x.ndim < 1 or w_t.ndim != 2 or x.shape[-1] != w_t.shape[1]:
        raise ValueError(f"streamed_matmul: x {x.shape} and w_t {w_t.shape} are not "
                         "[..., K] and [N, K]")
    return on_cpu(_streamed, _dot_t, x, w_t)


def _reverse_last(x: Array, n: int) -> Array:
    """Reverses the order of x's last n axes."""
    lead = list(range(x.ndim - n))
    return x.transpose(*lead, *reversed(range(x.ndim - n, x.ndim)))


def streamed_projection(x: Array, kernel_t: Array, in_dims: int) -> Array:
    """x [..., *in] times a kernel [*in, *out] given as kernel_t = kernel.T.

    Args:
      x: [..., *in] activations (few rows).
      kernel_t: [*reversed(out), *reversed(in)], the kernel with all axes
        reversed (what `decode_weights` stores).
      in_dims: how many trailing axes of x are contracted.

    Returns:
      [..., *out] float32.
    """
    out_rev = kernel_t.shape[:kernel_t.ndim - in_dims]
    lead = x.shape[:x.ndim - in_dims]
    fan_in, fan_out = math.prod(x.shape[x.ndim - in_dims:]), math.prod(out_rev)
    rows = _reverse_last(x, in_dims).reshape(*lead, fan_in)
    y = streamed_matmul(rows, kernel_t.reshape(fan_out, fan_in))
    return _reverse_last(y.reshape(*lead, *out_rev), len(out_rev))


def fused_qkv_t(query: Array, key: Array, value: Array) -> Array:
    """Self-attention's three kernels [D, heads, dim] as one streamed [sum(heads*dim), D].

    Rows are each kernel's (heads, dim) pairs in order, so each output slice
    reshapes to [..., heads, dim] in place; one product against all three avoids
    three products that would share one broadcast of x, which XLA:CPU then stores.
    """
    return jnp.concatenate([k.reshape(k.shape[0], -1).T for k in (query, key, value)])


def decode_weights(params) -> dict:
    """The streamed-layout weights a CPU decoding step reads, built from `params`.

    For every parameter dict holding a "kernel": "kernel_t" = kernel.T (all
    axes reversed); for every dict holding "query", "key" and "value"
    projections: "qkv_t" (`fused_qkv_t`). The tree mirrors `params`, so it is
    passed as the "decode_weights" collection next to them. Entries a step
    does not read cost nothing under jit (dead code).

    Args:
      params: a module's parameters (unboxed).

    Returns:
      The "decode_weights" collection (empty dicts where nothing applies).
    """
    out = {}
    for name, value in params.items():
        if isinstance(value, Mapping) and (sub := decode_weights(value)):
            out[name] = sub
    if "kernel" in params:
        out["kernel_t"] = jnp.asarray(params["kernel"]).T
    projections = [params.get(p) for p in ("query", "key", "value")]
    if all(isinstance(p, Mapping) and "kernel" in p for p in projections):
        out["qkv_t"] = fused_qkv_t(*(p["kernel"] for p in projections))
    return out


def read_decode_weight(module, name: str) -> Array | None:
    """`module`'s entry `name` of the "decode_weights" collection, if the caller passed it."""
    if module.has_variable(DECODE_WEIGHTS, name):
        return module.get_variable(DECODE_WEIGHTS, name)
    return None

"""The tied output projection and the smoothed loss in chunks, never storing the logits.

A training step with a V-word output layer materialises [B, T, V] float32
logits and their gradient: 2 x 131 MB at 4k tokens x 8k words, 2 x 800 MB
at 4k tokens x GPT-2's 50k. `chunked_output_loss` splits the target length
into `num_chunks` pieces; for each it forms the piece's logits, its loss
terms and, since the gradient of the smoothed cross entropy is known in
closed form (softmax - smoothed one-hot), that piece's gradients with
respect to the hidden states, the table and the bias. Only [B, T / num_chunks,
V] lives at once, and the backward pass is a scaling of the gradients the
forward pass already formed (the fused linear cross entropy of Liger
Kernel; MaxText's vocabulary tiling). The matmul FLOPs are the unchunked
step's (three products with the table); a piece is small enough to stay in
cache (8 MB at 4k tokens x 8k words in 16 pieces), and nothing [B, T, V]
is written to memory.

Values equal `label_smoothed_cross_entropy` and `token_metrics` on the
logits x @ table^T + bias (tests/train/test_chunked_loss.py), up to float32
summation order. The custom VJP makes it reverse-mode only, like the loss.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from transformer_zoo.models import cpu_kernels
from transformer_zoo.models.variants import Kernels
from transformer_zoo.train.losses import smoothed_one_hot, smoothed_terms

Array = Any

METRICS = ("loss_sum", "nll_sum", "correct_sum", "tokens")


def chunked_output_loss(hidden: Array, table: Array, bias: Array, targets: Array,
                        weights: Array, alpha: float, num_chunks: int,
                        kernels: Kernels = Kernels.PORTABLE) -> tuple[Array, dict[str, Array]]:
    """Summed smoothed cross entropy of logits hidden @ table^T + bias, by chunks.

    Args:
      hidden: [B, T, D] final decoder states (any float dtype).
      table: [V, D] tied output table (the target embedding).
      bias: [V] output bias (zeros when the model has none).
      targets: [B, T] int ids.
      weights: [B, T] 1.0 on real tokens, 0.0 on padding.
      alpha: label smoothing (0 = plain cross entropy).
      num_chunks: pieces of the length T (>= 1); T is padded with weight-0
        tokens to a multiple of it, so any T (e.g. a bucket's) works.
      kernels: Kernels.CPU forms the table's gradient in the CPU layer's
        order (models/cpu_kernels.py); the values are the same.

    Returns:
      (loss_sum, metrics): the loss to differentiate and the sums of
      `token_metrics` (loss_sum, nll_sum, correct_sum, tokens), which carry no
      gradient.
    """
    if hidden.shape[:-1] != targets.shape or targets.shape != weights.shape:
        raise ValueError(f"hidden {hidden.shape}, targets {targets.shape} and weights "
                         f"{weights.shape} disagree on [B, T]")
    if table.shape != (bias.shape[0], hidden.shape[-1]):
        raise ValueError(f"table {table.shape} must be [V, D] for bias {bias.shape} and "
                         f"hidden {hidden.shape}")
    if num_chunks < 1:
        raise ValueError(f"the loss's num_chunks must be >= 1, got {num_chunks}")
    pad = -targets.shape[1] % num_chunks
    if pad:  # weight-0 tokens: no loss, no gradient; autodiff of pad drops their rows
        hidden, targets, weights = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
                                    for a in (hidden, targets, weights))
    metrics = _chunked(hidden, table, bias, targets, weights.astype(jnp.float32),
                       float(alpha), int(num_chunks), Kernels(kernels))
    return metrics["loss_sum"], jax.lax.stop_gradient(metrics)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunked(hidden, table, bias, targets, weights, alpha, num_chunks, kernels):
    return _forward(hidden, table, bias, targets, weights, alpha, num_chunks, kernels)[0]


def _to_chunks(a: Array, num_chunks: int) -> Array:
    """[B, T, ...] -> [num_chunks, B, T / num_chunks, ...] (the batch axis kept whole,
    so a batch-sharded array stays sharded the same way)."""
    b, t = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, num_chunks, t // num_chunks, *a.shape[2:]), 1, 0)


def _from_chunks(a: Array) -> Array:
    n, b, tc = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(b, n * tc, *a.shape[3:])


def _forward(hidden, table, bias, targets, weights, alpha, num_chunks, kernels):
    vocab = table.shape[0]
    table32, bias32 = table.astype(jnp.float32), bias.astype(jnp.float32)

    def piece(carry, xs):
        sums, d_table_t, d_bias = carry
        x, y, w = xs  # [B, Tc, D], [B, Tc], [B, Tc]
        x = x.astype(jnp.float32)
        logits = jnp.einsum("btd,vd->btv", x, table32) + bias32
        terms = smoothed_terms(logits, y, alpha)
        nll = terms.lse - terms.target_logit
        correct = (terms.target_logit >= terms.top).astype(jnp.float32)
        sums = {"loss_sum": sums["loss_sum"] + (terms.loss * w).sum(),
                "nll_sum": sums["nll_sum"] + (nll * w).sum(),
                "correct_sum": sums["correct_sum"] + (correct * w).sum(),
                "tokens": sums["tokens"] + w.sum()}
        # d(sum_w loss)/d logits = w * (softmax - smoothed one-hot).
        probs = terms.shifted_exp / terms.total[..., None]
        g = (probs - smoothed_one_hot(y, vocab, alpha)) * w[..., None]
        dx = jnp.einsum("btv,vd->btd", g, table32)
        rows, g_rows = x.reshape(-1, x.shape[-1]), g.reshape(-1, vocab)
        return (sums, d_table_t + _rows_t_dot(rows, g_rows, kernels),
                d_bias + g_rows.sum(0)), dx

    zero = jnp.zeros((), jnp.float32)
    init = ({name: zero for name in METRICS},
            jnp.zeros(table.shape[::-1], jnp.float32), jnp.zeros(bias.shape, jnp.float32))
    xs = tuple(_to_chunks(a, num_chunks) for a in (hidden, targets, weights))
    (sums, d_table_t, d_bias), dx = jax.lax.scan(piece, init, xs)
    d_table = _transpose(d_table_t, kernels)
    grads = (_from_chunks(dx).astype(hidden.dtype), d_table.astype(table.dtype),
             d_bias.astype(bias.dtype))
    return sums, grads


def _rows_t_dot(rows: Array, g: Array, kernels: Kernels) -> Array:
    """rows^T g: [N, D], [N, V] -> [D, V]."""
    if kernels == Kernels.CPU:
        # A stored transpose keeps this a plain dot that YNNPACK takes (cpu_kernels).
        return cpu_kernels.stored_transpose(rows) @ g
    return rows.T @ g


def _transpose(a: Array, kernels: Kernels) -> Array:
    return cpu_kernels.stored_transpose(a) if kernels == Kernels.CPU else a.T


def _bwd(alpha, num_chunks, kernels, grads, cotangent):
    # Only loss_sum is differentiated; the metric sums' cotangents are ignored
    # (chunked_output_loss hands them out behind stop_gradient).
    g = cotangent["loss_sum"]
    d_hidden, d_table, d_bias = grads
    return (d_hidden * g.astype(d_hidden.dtype), d_table * g.astype(d_table.dtype),
            d_bias * g.astype(d_bias.dtype), None, None)


_chunked.defvjp(_forward, _bwd)  # the residuals are the gradients

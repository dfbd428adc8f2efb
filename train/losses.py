"""Label-smoothed cross entropy and token metrics.

With smoothing alpha over K classes the target distribution is
    y~ = (1 - alpha) * onehot(y) + alpha / K,
and the loss -sum_k y~_k log p_k. Its minimum (reached when p = y~) is the
entropy of y~, reported separately so that "loss - floor" goes to 0.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = Any


def smoothing_floor(alpha: float, num_classes: int) -> float:
    """Entropy of the smoothed target: the lowest reachable per-token loss."""
    if alpha <= 0.0:
        return 0.0
    high = 1.0 - alpha + alpha / num_classes
    low = alpha / num_classes
    return -(high * math.log(high) + (num_classes - 1) * low * math.log(low))


def label_smoothed_cross_entropy(
    logits: Array, targets: Array, weights: Array, alpha: float = 0.1
) -> tuple[Array, Array]:
    """Summed smoothed cross entropy over non-padding tokens.

    Args:
      logits: [B, T, V] (computed in float32).
      targets: [B, T] int ids.
      weights: [B, T] 1.0 on real tokens, 0.0 on padding.
      alpha: label smoothing (0 = plain cross entropy).

    Returns:
      (loss_sum, weight_sum): divide for the per-token mean.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on [B, T]")
    loss = smoothed_token_loss(logits.astype(jnp.float32), targets, float(alpha))
    weights = weights.astype(jnp.float32)
    return (loss * weights).sum(), weights.sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def smoothed_token_loss(logits: Array, targets: Array, alpha: float) -> Array:
    """Per-token -sum_k y~_k log softmax(logits)_k: [B, T, V] float32 -> [B, T].

    Equal to the log_softmax formula; the hand-written gradient softmax - y~
    builds the one-hot from an iota comparison in one elementwise pass, where
    autodiff of log_softmax + take_along_axis computes it twice (once through
    a scatter) and XLA:CPU fuses one copy into a slow transposed write.
    """
    return _smoothed_fwd(logits, targets, alpha)[0]


class SmoothedTerms(NamedTuple):
    """Per-token pieces of the smoothed loss, each [...] for [..., V] logits."""

    loss: Array  # -sum_k y~_k log p_k
    lse: Array  # log sum_k exp(logits_k)
    target_logit: Array  # logits_y
    top: Array  # max_k logits_k (no gradient)
    shifted_exp: Array  # [..., V] exp(logits - top), kept for softmax = shifted_exp / total
    total: Array  # sum_k shifted_exp_k


def smoothed_terms(logits: Array, targets: Array, alpha: float) -> SmoothedTerms:
    """The smoothed loss and what its gradient and the metrics reuse.

    Shared by `smoothed_token_loss` and train/chunked_loss.py; XLA drops the
    pieces a caller does not use.

    Args:
      logits: [..., V] float32.
      targets: [...] int ids.
      alpha: label smoothing (0 = plain cross entropy).
    """
    num_classes = logits.shape[-1]
    top = jax.lax.stop_gradient(logits.max(-1))
    shifted_exp = jnp.exp(logits - top[..., None])
    total = shifted_exp.sum(-1)
    lse = jnp.log(total) + top
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    # -(1-a) log p_y - (a/K) sum_k log p_k, with log p = logits - lse.
    loss = lse - (1.0 - alpha) * target_logit - (alpha / num_classes) * logits.sum(-1)
    return SmoothedTerms(loss, lse, target_logit, top, shifted_exp, total)


def smoothed_one_hot(targets: Array, num_classes: int, alpha: float) -> Array:
    """y~ = (1 - alpha) * onehot(targets) + alpha / K: [...] -> [..., K] float32.

    Built from an iota comparison in one elementwise pass (no scatter).
    """
    shape = (*targets.shape, num_classes)
    classes = jax.lax.broadcasted_iota(targets.dtype, shape, targets.ndim)
    low = alpha / num_classes
    return jnp.where(classes == targets[..., None], 1.0 - alpha + low, low)


def _smoothed_fwd(logits, targets, alpha):
    terms = smoothed_terms(logits, targets, alpha)
    return terms.loss, (logits, terms.lse, targets)


def _smoothed_bwd(alpha, residuals, g):
    logits, lse, targets = residuals
    probs = jnp.exp(logits - lse[..., None])
    return (probs - smoothed_one_hot(targets, logits.shape[-1], alpha)) * g[..., None], None


smoothed_token_loss.defvjp(_smoothed_fwd, _smoothed_bwd)


def token_metrics(
    logits: Array, targets: Array, weights: Array, alpha: float
) -> dict[str, Array]:
    """Sums for loss, nll (unsmoothed), correct tokens and token count.

    A token is correct when its target's logit is the row's maximum. That is
    argmax(logits) == target except on exact ties for the maximum (argmax takes
    the lowest index), and it costs one plain max-reduce, which the loss needs
    anyway: XLA:CPU lowers argmax to a (value, index) reduce that runs ~10-30x
    slower than a max over the same [B, T, V] logits (benchmarks/README.md).
    """
    loss, count = label_smoothed_cross_entropy(logits, targets, weights, alpha)
    nll, _ = label_smoothed_cross_entropy(logits, targets, weights, 0.0)
    logits = logits.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (target_logit >= logits.max(-1)).astype(jnp.float32) * weights
    return {"loss_sum": loss, "nll_sum": nll, "correct_sum": correct.sum(), "tokens": count}


def summarize(sums: dict[str, Array], alpha: float, num_classes: int) -> dict[str, float]:
    """Per-token loss, loss above the smoothing floor, accuracy and perplexity."""
    tokens = max(float(sums["tokens"]), 1.0)
    loss = float(sums["loss_sum"]) / tokens
    nll = float(sums["nll_sum"]) / tokens
    return {
        "loss": loss,
        "loss_above_floor": loss - smoothing_floor(alpha, num_classes),
        "nll": nll,
        "accuracy": float(sums["correct_sum"]) / tokens,
        "perplexity": math.exp(min(nll, 50.0)),
    }

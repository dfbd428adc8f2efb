"""Label-smoothed cross entropy and token metrics.

With smoothing alpha over K classes the target distribution is
    y~ = (1 - alpha) * onehot(y) + alpha / K,
and the loss -sum_k y~_k log p_k. Its minimum (reached when p = y~) is the
entropy of y~, reported separately so that "loss - floor" goes to 0.
"""

from __future__ import annotations

import math
from typing import Any

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
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    num_classes = logits.shape[-1]
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    loss = -((1.0 - alpha) * target_logp + (alpha / num_classes) * logp.sum(-1))
    weights = weights.astype(jnp.float32)
    return (loss * weights).sum(), weights.sum()


def token_metrics(
    logits: Array, targets: Array, weights: Array, alpha: float
) -> dict[str, Array]:
    """Sums for loss, nll (unsmoothed), correct tokens and token count."""
    loss, count = label_smoothed_cross_entropy(logits, targets, weights, alpha)
    nll, _ = label_smoothed_cross_entropy(logits, targets, weights, 0.0)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * weights
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

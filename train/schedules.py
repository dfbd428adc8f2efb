"""Learning-rate schedules (optax), including the paper's warmup.

rsqrt_warmup (Vaswani et al. 2017, eq. 3):
    lr(step) = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
with step counted from 1.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
import optax

from transformer_zoo.models.variants import parse


class Schedule(enum.StrEnum):
    """The learning-rate schedules of `make_schedule` (the config's optim.schedule)."""

    RSQRT_WARMUP = "rsqrt_warmup"  # the paper's eq. 3, scaled by the peak
    WARMUP_COSINE = "warmup_cosine"  # linear warmup, cosine decay to end_value
    INVERSE_SQRT = "inverse_sqrt"  # linear warmup to the peak, then 1/sqrt(step)
    CONSTANT = "constant"


def rsqrt_warmup(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """The paper's schedule: linear warmup, then decay with the inverse square root."""
    _check_warmup(warmup_steps)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # optax counts from 0, the paper from 1
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def inverse_sqrt(peak: float, warmup_steps: int) -> optax.Schedule:
    """Linear warmup to `peak`, then peak * sqrt(warmup / step)."""
    _check_warmup(warmup_steps)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return peak * jnp.minimum(step / warmup_steps, jnp.sqrt(warmup_steps / step))

    return schedule


def make_schedule(
    name: Schedule | str,
    *,
    d_model: int,
    peak: float,
    warmup_steps: int,
    total_steps: int,
    end_value: float = 0.0,
) -> optax.Schedule:
    """The schedule called `name`.

    Args:
      name: a `Schedule` (or its value).
      d_model: model width (rsqrt_warmup).
      peak: peak learning rate; for rsqrt_warmup a multiplier of the formula.
      warmup_steps: linear warmup length.
      total_steps: run length (warmup_cosine decays until then).
      end_value: final value of warmup_cosine.

    Raises:
      ValueError: an unknown name, or a warmup that does not fit.
    """
    name = parse(Schedule, name, "optim.schedule")
    if name == Schedule.RSQRT_WARMUP:
        return rsqrt_warmup(d_model, warmup_steps, peak)
    if name == Schedule.WARMUP_COSINE:
        _check_warmup(warmup_steps)
        if total_steps <= warmup_steps:
            raise ValueError(f"total_steps={total_steps} must exceed warmup_steps={warmup_steps}")
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps, total_steps, end_value)
    if name == Schedule.INVERSE_SQRT:
        return inverse_sqrt(peak, warmup_steps)
    return optax.constant_schedule(peak)


def _check_warmup(warmup_steps: int) -> None:
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be positive, got {warmup_steps}")

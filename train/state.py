"""TrainState and the optax optimizer built from the run config."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct, traverse_util

from transformer_zoo.models.variants import parse
from transformer_zoo.train.schedules import make_schedule

Array = Any


class Optimizer(enum.StrEnum):
    """The optimizers of `make_optimizer` (the config's optim.name)."""

    ADAM = "adam"  # the paper's
    ADAMW = "adamw"  # decoupled weight decay, masked off norms and biases


@struct.dataclass
class TrainState:
    """Everything a step needs; a pytree, so it can be jitted and checkpointed.

    Attributes:
      step: number of optimizer updates applied.
      params: model parameters (unboxed arrays).
      opt_state: optax state.
      rng: base PRNG key; step k uses fold_in(rng, k), so dropout is
        reproducible from the seed and identical after a resume.
      tx: the optax transformation (static).
    """

    step: Array
    params: Any
    opt_state: Any
    rng: Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    def apply_gradients(self, grads) -> TrainState:
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)

    def step_rng(self) -> Array:
        return jax.random.fold_in(self.rng, self.step)


def create_train_state(params, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh state at step 0."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(seed + 1)),
        tx=tx,
    )


def decay_mask(params) -> Any:
    """True for weights that get weight decay: not biases, not norm scales, not vectors."""
    flat = traverse_util.flatten_dict(params)
    mask = {path: (path[-1] not in ("bias", "scale") and leaf.ndim > 1)
            for path, leaf in flat.items()}
    return traverse_util.unflatten_dict(mask)


def check_weight_decay(name: str, weight_decay: float) -> None:
    """ValueError for a weight decay the chosen optimizer would not apply.

    Adam here is the paper's, with no decay term: a decay left set (say from a recipe
    that uses AdamW) would be ignored without a word, so it is refused instead.
    """
    if parse(Optimizer, name, "optim.name") == Optimizer.ADAM and weight_decay:
        raise ValueError(f"optim.weight_decay={weight_decay} is applied by "
                         "optim.name='adamw' only; with optim.name='adam' set "
                         "optim.weight_decay=0")


def make_optimizer(optim, d_model: int, total_steps: int) -> tuple[optax.GradientTransformation,
                                                                    Callable]:
    """The optimizer described by the run config's `optim` section.

    Returns:
      (tx, schedule): the transformation and its learning-rate schedule.
    """
    name = parse(Optimizer, optim.name, "optim.name")
    check_weight_decay(name, optim.weight_decay)
    schedule = make_schedule(
        optim.schedule, d_model=d_model, peak=optim.learning_rate,
        warmup_steps=optim.warmup_steps, total_steps=total_steps,
        end_value=optim.get("end_learning_rate", 0.0),
    )
    if name == Optimizer.ADAM:
        core = optax.adam(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps)
    else:
        core = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                           weight_decay=optim.weight_decay, mask=decay_mask)
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm else []
    tx = optax.chain(*parts, core)
    if optim.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=optim.grad_accum_steps)
    elif optim.grad_accum_steps < 1:
        raise ValueError(f"optim.grad_accum_steps must be >= 1, got {optim.grad_accum_steps}")
    return tx, schedule

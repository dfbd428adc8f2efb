"""Pure step functions: train_step(state, batch) -> (state, metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_zoo.train.chunked_loss import chunked_output_loss
from transformer_zoo.train.losses import label_smoothed_cross_entropy, token_metrics
from transformer_zoo.train.state import TrainState
from transformer_zoo.train.tasks import Family, Task, get_task

Array = Any


def make_train_step(model, task: Task | Family | str, label_smoothing: float,
                    schedule: Callable | None = None, axis_name: Any = None,
                    loss_chunks: int = 0) -> Callable:
    """The (unjitted) train step for `model`.

    The loss is the label-smoothed cross entropy summed over target tokens and
    divided by their count (per-token mean). Dropout uses fold_in(rng, step).

    Args:
      model: the family's linen module.
      task: its train.tasks.Task (or the family's name).
      label_smoothing: epsilon_ls of the loss.
      schedule: the learning-rate schedule, to log the rate (None: not logged).
      axis_name: None for a global-view step (one device or jit + shardings).
        Under shard_map/pmap, the axis name(s) holding the batch shards: the
        token count, gradients and metric sums are psum'd over them, so the
        step equals the global one; the device index is folded into the
        dropout key so shards draw different masks.
      loss_chunks: 0 = the loss on the model's logits. n >= 1: the tied output
        layer and the loss in n pieces of the target length, never storing the
        [B, T, V] logits (train/chunked_loss.py; same values, generating
        families with tie_output only).

    With model.config.output_ids, the loss is a softmax over those ids alone
    (label smoothing spread over them): the logits of the others are masked
    by the model, and the chunked loss forms only those rows' logits.
    """
    task = get_task(task)
    _check_loss_chunks(model, task, loss_chunks)
    output_ids = _output_ids(model)

    def loss_fn(params, batch, rng):
        if loss_chunks:
            return _chunked_loss(params, batch, rng)
        logits, targets, weights = task.forward(model, params, batch, deterministic=False,
                                                rngs={"dropout": rng})
        logits, targets = restrict_to_outputs(output_ids, logits, targets)
        loss_sum, count = label_smoothed_cross_entropy(logits, targets, weights, label_smoothing)
        metrics = token_metrics(jax.lax.stop_gradient(logits), targets, weights, label_smoothing)
        return _mean(loss_sum, count, metrics)

    def _chunked_loss(params, batch, rng):
        hidden, (table, bias), targets, weights = task.forward_hidden(
            model, params, batch, deterministic=False, rngs={"dropout": rng})
        if output_ids is not None:  # the output layer of those rows alone: a smaller one
            table, bias = table[output_ids], bias[output_ids]
            targets = output_positions(output_ids, targets)
        loss_sum, metrics = chunked_output_loss(hidden, table, bias, targets, weights,
                                                label_smoothing, loss_chunks,
                                                model.config.kernels)
        return _mean(loss_sum, metrics["tokens"], metrics)

    def _mean(loss_sum, count, metrics):
        if axis_name is not None:  # divide by the global count: psum(grads) is then the mean
            count = jax.lax.psum(count, axis_name)
        return loss_sum / jnp.maximum(count, 1.0), metrics

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict[str, Array]]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        rng = state.step_rng()
        if axis_name is not None:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
        (loss, metrics), grads = grad_fn(state.params, batch, rng)
        if axis_name is not None:
            loss, metrics, grads = jax.lax.psum((loss, metrics, grads), axis_name)
        new_state = state.apply_gradients(grads)
        metrics = dict(metrics, loss=loss, grad_norm=_global_norm(grads))
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        return new_state, metrics

    return train_step


def _check_loss_chunks(model, task: Task, loss_chunks: int) -> None:
    if loss_chunks < 0:
        raise ValueError(f"loss_chunks must be >= 0 (0 = off), got {loss_chunks}")
    if not loss_chunks:
        return
    if not task.generates:
        raise ValueError(f"loss_chunks={loss_chunks} needs a generating family (encoder_decoder "
                         f"or decoder_only), got {task.family}")
    if not model.config.tie_output:
        raise ValueError(f"loss_chunks={loss_chunks} needs tie_output=True (the chunked loss "
                         "reads the tied embedding table)")


def make_eval_step(model, task: Task | Family | str, label_smoothing: float) -> Callable:
    """eval_step(params, batch) -> metric sums (deterministic forward)."""
    task = get_task(task)

    output_ids = _output_ids(model)

    def eval_step(params, batch):
        logits, targets, weights = task.forward(model, params, batch, deterministic=True)
        logits, targets = restrict_to_outputs(output_ids, logits, targets)
        return token_metrics(logits, targets, weights, label_smoothing)

    return eval_step


def _output_ids(model) -> np.ndarray | None:
    ids = model.config.output_ids
    return None if ids is None else np.asarray(ids, np.int32)


def output_positions(output_ids: Array, targets: Array) -> Array:
    """Target ids [B, T] as positions in the ascending `output_ids` [K] (the data spells
    targets with those ids; an id outside them only occurs as weight-0 padding)."""
    return jnp.clip(jnp.searchsorted(output_ids, targets), 0, output_ids.shape[0] - 1)


def restrict_to_outputs(output_ids: Array | None, logits: Array,
                        targets: Array) -> tuple[Array, Array]:
    """([B, T, K] logits of the output ids, targets as positions among them); as
    given when output_ids is None."""
    if output_ids is None:
        return logits, targets
    return jnp.take(logits, output_ids, axis=-1), output_positions(output_ids, targets)


def _global_norm(tree) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))

"""Orbax checkpoints: save, resume, restore params only, average.

A checkpoint step holds four items:
  params     the model parameters (all decoding needs)
  opt_state  the optax state
  meta       step and PRNG key
  data       the data iterator state (JSON)
and every checkpoint directory also holds `config` (JSON: the run config and
the resolved model config). Orbax writes each step to a temporary directory
and renames it when complete, so a partially written step is never listed or
restored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

ARRAY_ITEMS = ("params", "opt_state", "meta")

def checkpoint_dir(workdir: str | Path) -> Path:
    return Path(workdir).absolute() / "checkpoints"


class Checkpointer:
    """CheckpointManager wrapper: keep the last `keep` steps and the best one.

    Args:
      workdir: run directory; checkpoints go to workdir/checkpoints.
      keep: how many of the latest steps to keep.
      best_metric: metric name whose best step is kept as well (None: off).
      best_mode: "min" or "max" for best_metric.
      async_save: save in a background thread (wait() before exit).
      read_only: open an existing directory for restoring only.
    """

    def __init__(self, workdir, *, keep: int = 3, best_metric: str | None = None,
                 best_mode: str = "min", async_save: bool = True, read_only: bool = False):
        policies = [pp.LatestN(keep)]
        if best_metric:
            policies.append(pp.BestN(get_metric_fn=lambda m: m[best_metric], n=1,
                                     reverse=best_mode == "min"))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=pp.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            read_only=read_only,
            create=not read_only,
        )
        self.directory = checkpoint_dir(workdir)
        handlers = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
        handlers.update(data=ocp.JsonCheckpointHandler(), config=ocp.JsonCheckpointHandler())
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_state: Mapping, config: Mapping,
             metrics: Mapping[str, float] | None = None) -> None:
        """Saves the train state, the data iterator state and the config at `step`."""
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.StandardSave({"step": state.step, "rng": state.rng}),
            data=ocp.args.JsonSave(dict(data_state)),
            config=ocp.args.JsonSave(dict(config)),
        )
        self.manager.save(step, args=args, metrics=dict(metrics) if metrics else None, force=True)

    def save_params(self, step: int, params, config: Mapping) -> None:
        """A params-only checkpoint (e.g. an average), decodable but not resumable."""
        args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                                  config=ocp.args.JsonSave(dict(config)))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, state) -> tuple[Any, dict]:
        """Restores into the structure of `state` (arrays or ShapeDtypeStructs).

        Raises:
          ValueError: the checkpoint's parameters do not match `state.params`
            (names the first mismatched parameter and both shapes).
        """
        self.check_compatible(step, state.params)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(state.params)),
            opt_state=ocp.args.StandardRestore(_abstract(state.opt_state)),
            meta=ocp.args.StandardRestore(_abstract({"step": state.step, "rng": state.rng})),
            data=ocp.args.JsonRestore(),
        ))
        new_state = state.replace(params=restored.params, opt_state=restored.opt_state,
                                  step=restored.meta["step"], rng=restored.meta["rng"])
        return new_state, dict(restored.data)

    def restore_params(self, step: int, params_like) -> Any:
        """Restores only the parameters (no optimizer state is read)."""
        self.check_compatible(step, params_like)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like))))
        return restored.params

    def restore_config(self, step: int) -> dict:
        return dict(self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config)

    def check_compatible(self, step: int, params_like) -> None:
        """Compares saved parameter shapes with the model's, before touching anything."""
        saved = self.manager.item_metadata(step)["params"]
        saved_shapes = {k: tuple(v.shape) for k, v in _flatten(saved).items()}
        wanted = {k: tuple(np.shape(v)) for k, v in _flatten(params_like).items()}
        for name in sorted(set(saved_shapes) | set(wanted)):
            have, want = saved_shapes.get(name), wanted.get(name)
            if have != want:
                raise ValueError(
                    f"checkpoint {self.directory} step {step} is incompatible with this config: "
                    f"parameter {name} has shape {have} in the checkpoint but {want} in the model"
                )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _flatten(tree) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in leaves}


def _abstract(tree):
    """Restore targets: each leaf's shape, dtype and sharding.

    A ShapeDtypeStruct without a sharding restores onto the first local device:
    left unset, orbax would reuse the saved sharding and fail on any other
    device topology (e.g. decoding on 1 device what 8 devices wrote).
    """
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            if x.sharding is not None:
                return x
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def average_params(param_trees: list) -> Any:
    """Element-wise mean of several parameter trees (computed in float32)."""
    if not param_trees:
        raise ValueError("average_params needs at least one parameter tree")
    return jax.tree.map(
        lambda *xs: (sum(np.asarray(x, np.float32) for x in xs) / len(xs)).astype(xs[0].dtype),
        *param_trees,
    )


def average_checkpoints(workdir, output_workdir, last_n: int, params_like) -> int:
    """Averages the params of the last `last_n` checkpoints of `workdir`.

    The result is saved as a params-only checkpoint at the latest step in
    `output_workdir` (which must not hold checkpoints yet), with the config.

    Returns:
      The step of the averaged checkpoint.
    """
    source = Checkpointer(workdir, read_only=True, async_save=False)
    steps = source.all_steps()
    if len(steps) < last_n:
        raise ValueError(
            f"{workdir} has {len(steps)} checkpoints {steps}; asked to average {last_n}")
    steps = steps[-last_n:]
    logging.info("averaging steps %s of %s", steps, workdir)
    trees = [jax.device_get(source.restore_params(s, params_like)) for s in steps]
    config = source.restore_config(steps[-1])
    config["averaged_steps"] = steps
    target_dir = checkpoint_dir(output_workdir)
    if target_dir.exists() and any(target_dir.iterdir()):
        raise ValueError(f"{target_dir} already holds checkpoints; choose an empty output workdir")
    target = Checkpointer(output_workdir, async_save=False)
    target.save_params(steps[-1], average_params(trees), config)
    target.wait()
    return steps[-1]


def write_json(path: str | Path, payload: Mapping) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")

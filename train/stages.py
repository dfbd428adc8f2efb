"""A pre-stage: train first under other settings, then continue from its params.

A sequence-length curriculum is the use this is made for (short rows, many cheap
steps, then the long context the model is for: Press et al. 2021's staged
training in Shortformer), but any settings of the model-preserving sections may
differ. A recipe puts the overrides in `config.pre_stage`, by section:

    config.pre_stage = ml_collections.ConfigDict(dict(
        data=dict(seq_length=64, batch_size=12), train=dict(num_steps=9000)))

One command then trains the pre-stage in WORKDIR/pre_stage (resumable like any
run, skipped once finished), and the run itself in WORKDIR from the pre-stage's
final params (`init_from`, so the optimizer starts afresh with the run's own
schedule). The model must be the same in both: `init_from` refuses another.
`--config.pre_stage.train.num_steps=0` switches a recipe's pre-stage off.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from transformer_zoo.configs import schema
from transformer_zoo.train.checkpoint import Checkpointer

STAGE_DIR = "pre_stage"


def split(config) -> tuple[object | None, object]:
    """(the pre-stage's config, checked, or None; the run's config, as given).

    The run's config is checked by the loop that trains it.

    Raises:
      ValueError: a pre_stage section or field that the run config does not
        have (naming it and the section's fields), a value it refuses, or a
        model field that would change what the model computes.
    """
    overrides = config.get("pre_stage") or {}
    if not overrides or (overrides.get("train") or {}).get("num_steps") == 0:
        return None, config  # none, or switched off (--config.pre_stage.train.num_steps=0)
    stage = copy.deepcopy(config)
    stage.pre_stage = {}
    for name, values in overrides.items():
        section = stage.get(name)
        if not hasattr(section, "items") or not hasattr(values, "items"):
            raise ValueError(f"pre_stage.{name} is not a section of the run config; the "
                             "pre-stage overrides fields of model, data, optim, train or decode")
        for key, value in values.items():
            if key not in section:
                fields = {k: None for k in section}
                raise schema.unknown_key(key, fields, f"pre_stage.{name}", name)
            _check_model_kept(name, key, value, section[key])
            section[key] = value
    schema.check(stage)
    return stage, config


def _check_model_kept(section: str, key: str, value, run_value) -> None:
    """The run starts from the pre-stage's params: only how to compute may differ."""
    if section == "model" and key not in schema.FINE_TUNABLE_MODEL_FIELDS and value != run_value:
        raise ValueError(f"pre_stage.model.{key}={value!r} differs from model.{key}="
                         f"{run_value!r}; the run continues from the pre-stage's params, so "
                         f"only {sorted(schema.FINE_TUNABLE_MODEL_FIELDS)} may differ")


def run_with_pre_stage(config, workdir, train: Callable) -> dict[str, float]:
    """Trains the pre-stage (unless finished), then the run from its params.

    Args:
      config: the run config; its `pre_stage` may be empty (then only the run).
      workdir: the run's directory; the pre-stage's is WORKDIR/pre_stage.
      train: train(config, workdir) -> metrics, the loop of one run.

    Returns:
      The run's metrics, or the pre-stage's if it stopped early (a signal): the
      run then starts only when the command is repeated.
    """
    stage, config = split(config)
    if stage is None:
        return train(config, workdir)
    stage_dir = Path(workdir) / STAGE_DIR
    if not _finished(stage_dir, stage.train.num_steps):
        result = train(stage, stage_dir)
        if not _finished(stage_dir, stage.train.num_steps):
            return result
    config = copy.deepcopy(config)
    config.pre_stage = {}
    config.init_from = str(stage_dir)
    return train(config, workdir)


def _finished(stage_dir: Path, num_steps: int) -> bool:
    """Whether the pre-stage wrote its final metrics at exactly num_steps.

    Raises:
      ValueError: the directory holds a later step (another, longer pre-stage),
        which is neither reused nor overwritten.
    """
    if not stage_dir.is_dir():
        return False
    latest = Checkpointer(stage_dir, read_only=True, async_save=False).latest_step()
    if latest is not None and latest > num_steps:
        raise ValueError(f"{stage_dir} holds step {latest}, past pre_stage.train.num_steps="
                         f"{num_steps}; move it away to train this pre-stage")
    return latest == num_steps and (stage_dir / "final_metrics.json").is_file()

"""Multi-device checks run in a subprocess (the device count is fixed at jax import).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.train.parallel_worker \
        MODE WORKDIR

Modes print one JSON line (prefixed RESULT) that tests/train/test_parallel.py reads:
  equivalence  3 steps' losses under every mesh / step variant + how params are sharded
  train        train_and_evaluate with the config in $PARALLEL_OVERRIDES (JSON), e.g.
               one of two jax.distributed processes
  restore      restore WORKDIR's checkpoint under a 2x4 data x tensor mesh; parameter hashes
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax
import numpy as np

from tests.train import tiny_config
from transformer_zoo import data
from transformer_zoo.data.synthetic import NUMBER_WORDS
from transformer_zoo.train import parallel
from transformer_zoo.train.input import build_input
from transformer_zoo.train.loop import init_state, restore_or_start, setup, train_and_evaluate
from transformer_zoo.train.state import make_optimizer
from transformer_zoo.train.step import make_train_step
from transformer_zoo.train.tasks import build_model, model_config_from

NUM_STEPS = 3
VARIANTS = {  # name: (mesh_shape, step)
    "dp8": ((-1, 1, 1), "jit"),
    "dp2_tp4": ((2, 1, 4), "jit"),
    "fsdp8": ((1, -1, 1), "jit"),
    "shard_map8": ((-1, 1, 1), "shard_map"),
    "pmap8": ((-1, 1, 1), "pmap"),
}


def config(dropout: float = 0.0):
    """The tiny recipe with 4 heads (splittable by tp=4) and no dropout by default."""
    cfg = tiny_config.get_config()
    cfg.model.update(num_heads=4, dropout_rate=dropout)
    cfg.data.num_train_examples = 400
    return cfg


def _losses(cfg, workdir, mesh_shape, step_kind, devices,
            output_ids=None) -> tuple[list[float], object]:
    cfg.parallel.update(mesh_shape=mesh_shape, step=step_kind)
    inp = build_input(cfg, workdir)
    model_config = model_config_from(cfg.model, inp.tokenizer.vocab_size, output_ids=output_ids)
    model = build_model(cfg.family, model_config)
    tx, schedule = make_optimizer(cfg.optim, model_config.d_model, cfg.train.num_steps)
    plan = parallel.Plan.from_config(cfg.parallel, devices)
    state, shardings = init_state(model, cfg.family, tx, cfg.seed, plan)
    step_fn = make_train_step(model, cfg.family, cfg.train.label_smoothing, schedule,
                              axis_name=plan.axis_name, loss_chunks=cfg.train.loss_chunks)
    train_step = plan.jit_train_step(step_fn, shardings)
    it, losses = iter(inp.train), []
    placed = plan.place_state(state)
    for _ in range(NUM_STEPS):
        placed, metrics = train_step(placed, plan.batch(next(it)))
        losses.append(float(metrics["loss"]))
    return losses, plan.global_state(placed, state)


def _sharding_report(params) -> dict:
    """Per parameter: global shape, PartitionSpec and per-device shard shapes."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        shards = {tuple(s.data.shape) for s in x.addressable_shards}
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = {
            "shape": list(x.shape), "spec": str(x.sharding.spec),
            "shard_shapes": sorted(list(s) for s in shards), "devices": len(x.sharding.device_set)}
    return out


def equivalence(workdir: str) -> dict:
    one = jax.devices()[:1]
    result = {"one": _losses(config(), workdir, (1, 1, 1), "jit", one)[0]}
    reports = {}
    for name, (shape, step) in VARIANTS.items():
        result[name], state = _losses(config(), workdir, shape, step, None)
        if name in ("dp2_tp4", "fsdp8"):
            reports[name] = _sharding_report(state.params)
            reports[name + "_opt"] = _sharding_report(state.opt_state)
    # jit variants draw dropout by global position: equal to one device with dropout on.
    result["dropout_one"] = _losses(config(0.1), workdir, (1, 1, 1), "jit", one)[0]
    result["dropout_dp2_tp4"] = _losses(config(0.1), workdir, (2, 1, 4), "jit", None)[0]
    # The chunked output layer + loss (train.loss_chunks) under a sharded jit and shard_map.
    for name in ("dp2_tp4", "shard_map8"):
        chunked = config()
        chunked.train.loss_chunks = 4
        shape, step = VARIANTS[name]
        result["chunked_" + name] = _losses(chunked, workdir, shape, step, None)[0]
    # The output layer over the target side's ids (the number words, EOS and UNK: no
    # digit), its rows gathered from a vocabulary-sharded table.
    words = tuple(sorted({data.EOS_ID, data.UNK_ID,
                          *data.number_tokenizer().encode(" ".join(NUMBER_WORDS))}))
    result["words_one"] = _losses(chunked, workdir, (1, 1, 1), "jit", one, words)[0]
    for name in ("dp2_tp4", "shard_map8"):
        shape, step = VARIANTS[name]
        result["words_" + name] = _losses(chunked, workdir, shape, step, None, words)[0]
    return {"losses": result, "shardings": reports}


def param_hashes(params) -> dict[str, str]:
    """sha1 of every parameter's bytes: equal hashes = bitwise identical parameters."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"):
            hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest() for p, x in leaves}


def restore(workdir: str) -> dict:
    """Restores WORKDIR's latest checkpoint under a 2x4 data x tensor mesh."""
    cfg = _saved_config(workdir)
    cfg.parallel.update(mesh_shape=(2, 1, 4))
    state, _ = restore_or_start(setup(cfg, workdir))
    return {"step": int(state.step), "hashes": param_hashes(state.params),
            "shardings": _sharding_report(state.params)}


def _saved_config(workdir):
    cfg = config()
    cfg.update_from_flattened_dict(json.loads(os.environ.get("PARALLEL_OVERRIDES", "{}")))
    return cfg


def train(workdir: str) -> dict:
    cfg = _saved_config(workdir)
    metrics = train_and_evaluate(cfg, workdir)
    return {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "metrics": metrics}


def main(mode: str, workdir: str) -> None:
    # Compilation dominates these tiny runs; every variant uses the same setting.
    jax.config.update("jax_disable_most_optimizations", True)
    result = {"equivalence": equivalence, "train": train, "restore": restore}[mode](workdir)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])

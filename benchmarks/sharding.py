"""Per-device memory and collectives of the train step under dp=8, fsdp=8 and tp=8.

    python benchmarks/sharding.py                   # base and big, 2+2 layers compiled
    python benchmarks/sharding.py --compile-layers 6   # the full 6+6 stacks (slow on CPU)

For the paper's base and big models (models.get_preset) with Adam, on 8 fake CPU
devices (XLA_FLAGS is set before jax is imported):
  * params / Adam MiB per device: from the real shardings of train/parallel.py
    (jax.eval_shape of the init + the logical axis rules of configs/common.py;
    nothing is allocated); the maximum over devices of the summed shard sizes;
  * collectives: all-reduce / all-gather / reduce-scatter / collective-permute /
    all-to-all instructions in compiled.as_text() of the jit train step lowered
    with abstract inputs (batch 8 x 64 tokens). Counting is per program, not per
    execution; compiling is done on a model with --compile-layers encoder and
    decoder layers (bytes always use the full 6+6 model).
The reference column is dp=8 (plain data parallel).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import time
from pathlib import Path

DEVICES = 8
STRATEGIES = {"dp=8": (8, 1, 1), "fsdp=8": (1, 8, 1), "tp=8": (1, 1, 8)}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
MIB = 2**20


def _setup(name: str, mesh_shape, layers: int | None):
    """(model, abstract state, state shardings, plan) without allocating anything."""
    import jax

    from transformer_zoo.configs import common
    from transformer_zoo.models import get_preset
    from transformer_zoo.train import parallel
    from transformer_zoo.train.state import create_train_state, make_optimizer
    from transformer_zoo.train.tasks import get_task

    overrides = {} if layers is None else dict(num_encoder_layers=layers,
                                               num_decoder_layers=layers)
    model_config = get_preset(name, **overrides)
    task = get_task("encoder_decoder")
    model = task.build(model_config)
    cfg = common.base_config()
    tx, schedule = make_optimizer(cfg.optim, model_config.d_model, 100_000)

    def make():
        variables = model.init(jax.random.key(0), **task.dummy_batch())
        return create_train_state(_unbox(variables["params"]), tx, 0)

    cfg.parallel.mesh_shape = mesh_shape
    plan = parallel.Plan.from_config(cfg.parallel)
    abstract = jax.eval_shape(make)
    shardings = plan.shardings(model, "encoder_decoder", abstract)
    return model, abstract, shardings, plan, schedule


def _unbox(tree):
    import flax.linen as nn

    return nn.meta.unbox(tree)


def per_device_mib(abstract, shardings) -> float:
    """Max over devices of the summed bytes of the shards each device holds."""
    import jax

    totals = collections.Counter()
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings),
                              strict=True):
        shard = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for device in sharding.device_set:
            totals[device] += shard
    return max(totals.values()) / MIB


def count_collectives(name: str, mesh_shape, layers: int) -> tuple[dict[str, int], float]:
    """Collective instructions in the compiled train step, and compile seconds."""
    import jax
    import numpy as np

    from transformer_zoo.train import parallel
    from transformer_zoo.train.step import make_train_step
    from transformer_zoo.train.tasks import get_task

    model, abstract, shardings, plan, schedule = _setup(name, mesh_shape, layers)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, shardings)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                     sharding=parallel.batch_sharding(plan.mesh, np.ndim(v)))
             for k, v in get_task("encoder_decoder").dummy_batch(batch_size=8, length=64).items()}
    step = plan.jit_train_step(make_train_step(model, "encoder_decoder", 0.1, schedule),
                               shardings)
    t0 = time.perf_counter()
    text = step.lower(state, batch).compile().as_text()
    counts = collections.Counter(m.group(1) for m in _OP.finditer(text))
    return {c: counts.get(c, 0) for c in COLLECTIVES}, time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="base,big")
    parser.add_argument("--compile-layers", type=int, default=2,
                        help="encoder and decoder layers of the compiled step (memory: full)")
    args = parser.parse_args(argv)
    print("| model | strategy | params+Adam MiB/device | vs dp=8 | collectives (layers compiled) "
          "| all-reduce | all-gather | reduce-scatter | coll.-permute | all-to-all | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        reference = None
        for strategy, shape in STRATEGIES.items():
            _, abstract, shardings, _, _ = _setup(name, shape, None)
            mib = per_device_mib(abstract, shardings)
            reference = reference or mib
            counts, seconds = count_collectives(name, shape, args.compile_layers)
            cells = " | ".join(str(counts[c]) for c in COLLECTIVES)
            print(f"| {name} | {strategy} | {mib:.1f} | {mib / reference:.3f} | "
                  f"{sum(counts.values())} ({args.compile_layers}+{args.compile_layers}) | "
                  f"{cells} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()

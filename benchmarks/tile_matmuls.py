"""The blockwise kernel's tile products by tile shape: GFLOP/s on all cores and on one.

    python benchmarks/tile_matmuls.py          # ~1 min on 2 cores

Blockwise attention (models/blockwise_tiles.py) spends its time in batched
matmuls over R = 8 rows of (batch, head) with head dim 64, in three forms:
scores Q K^T ("rqh,rhs->rqs"), P V ("rqs,rsh->rqh") and the transposed
products of the backward pass (dK^T = Q^T dS, "rhq,rqs->rhs"). For each tile
shape (query rows x keys) this times each form, jitted, the best of 60
calls taken in 4 rounds over all shapes, once in a process that may use
every core and once in a process pinned to one core (os.sched_setaffinity
before jax is imported). "all / one" near 1
means XLA:CPU ran that product on a single thread even with more cores free;
"vs 512 x 512" is its speed relative to the default tile's, measured in the
same process. What tile splits can gain follows from these ratios
(benchmarks/README.md, "Attention at scale").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from by_turns import HEAD_DIM, best_by_turns

ROWS = 8
SHAPES = ((512, 512), (1024, 512), (512, 256), (256, 512), (256, 256), (128, 128))
FORMS = {"scores": "rqh,rhs->rqs", "pv": "rqs,rsh->rqh", "transposed": "rhq,rqs->rhs"}


def _operands(form: str, q: int, s: int):
    """The two operands of `form` for a q x s tile."""
    import jax

    shapes = {"scores": ((ROWS, q, HEAD_DIM), (ROWS, HEAD_DIM, s)),
              "pv": ((ROWS, q, s), (ROWS, s, HEAD_DIM)),
              "transposed": ((ROWS, HEAD_DIM, q), (ROWS, q, s))}[form]
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True)]


def worker(rounds: int = 4, calls: int = 15) -> dict:
    """GFLOP/s of every (shape, form) in this process, each the best of all its calls.

    All products are compiled first; then every round times `calls` calls of
    each in turn, so a busy spell on a shared host does not fall on one shape.
    """
    import jax
    import jax.numpy as jnp

    compiled = {}
    for q, s in SHAPES:
        for form, spec in FORMS.items():
            a, b = _operands(form, q, s)
            f = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b)).lower(a, b).compile()
            jax.block_until_ready(f(a, b))
            compiled[f"{q}x{s} {form}"] = (f, a, b, 2 * ROWS * q * s * HEAD_DIM)
    best = best_by_turns({key: (f, (a, b)) for key, (f, a, b, _) in compiled.items()},
                         rounds, calls)
    return {key: flops / best[key] / 1e9 for key, (_, _, _, flops) in compiled.items()}


def _run(one_core: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker"] + (["--one-core"] if one_core else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(every: dict, one: dict) -> str:
    head = ["tile (rows x keys)"] + [f"{f}: all cores / one core GFLOP/s" for f in FORMS]
    head += [f"{f}: all / one" for f in FORMS] + [f"{f}: vs 512 x 512" for f in FORMS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for q, s in SHAPES:
        keys = [f"{q}x{s} {f}" for f in FORMS]
        row = [f"{q} x {s}"] + [f"{every[k]:.0f} / {one[k]:.0f}" for k in keys]
        row += [f"{every[k] / one[k]:.2f}" for k in keys]
        row += [f"{every[k] / every[f'512x512 {f}']:.2f}" for k, f in zip(keys, FORMS, strict=True)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-core", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.one_core:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        print(json.dumps(worker()))
        return
    every, one = _run(one_core=False), _run(one_core=True)
    import jax

    print(f"R={ROWS} rows, head dim {HEAD_DIM}, float32; jax {jax.__version__}, "
          f"{len(os.sched_getaffinity(0))} cores")
    print(table(every, one))


if __name__ == "__main__":
    main()

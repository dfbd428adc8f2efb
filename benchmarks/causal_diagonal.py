"""What a causal mask's diagonal tiles cost blockwise attention, and what tile sizes change.

    python benchmarks/causal_diagonal.py            # N = 4096, ~4 min on 2 cores
    python benchmarks/causal_diagonal.py --n 8192

Forward + backward (jax.grad of sum(attention(q, k, v)) w.r.t. q, k, v), B=1,
8 heads, head dim 64, float32, as in benchmarks/attention.py. In one process
every variant is compiled first and then timed by turns (best of --runs each),
so load from elsewhere on the machine falls on all of them:

* no mask and causal at the default 512 x 512 tiles;
* "whole tiles only": a dense mask that shows each query tile exactly the key
  tiles before its own. Its tiles are the causal pass's wholly visible ones
  and it has no diagonal tiles, so causal minus it is what the diagonal costs;
* causal and no mask at 256 x 256 and 1024 x 1024 tiles;
* other ways to split a diagonal tile, patched into the tile loop for the
  trace: in two parts (the first half of queries x the first half of keys,
  the second half x all keys), and in four row strips (each quarter of queries
  x the keys up to its diagonal). The library splits it in three (the first
  part of the two halved again).

A second process runs no mask (512 tiles) and causal (256 tiles) with XLA:CPU's
YNNPACK fusion switched off (XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=),
where small products use every core (benchmarks/tile_matmuls.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

from by_turns import HEAD_DIM, HEADS, attention_inputs, best_by_turns, compiled_grad, timed

TILE = 512
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="
# name: (mask, tile, diagonal split: None for the library's)
VARIANTS = {
    "no mask": (None, TILE, None),
    "causal": ("causal", TILE, None),
    "whole tiles only (no diagonal)": ("below", TILE, None),
    "causal, diagonal in 2 parts": ("causal", TILE, "halves"),
    "causal, diagonal in 4 row strips": ("causal", TILE, "strips"),
    "no mask, 256 tiles": (None, 256, None),
    "causal, 256 tiles": ("causal", 256, None),
    "no mask, 1024 tiles": (None, 1024, None),
    "causal, 1024 tiles": ("causal", 1024, None),
}
YNN_OFF_VARIANTS = ("no mask", "causal, 256 tiles")


def _mask(kind: str | None, n: int):
    import jax.numpy as jnp

    from transformer_zoo.models.masks import make_attention_mask

    if kind == "causal":
        return make_attention_mask(None, q_len=n, causal=True)
    if kind == "below":
        tile = jnp.arange(n) // TILE
        dense = (tile[:, None] > tile[None, :])[None, None]
        return make_attention_mask(None, q_len=n).replace(dense=dense)
    return None


@contextlib.contextmanager
def _diagonal_split(split: str | None):
    """Splits diagonal (NESTED) tiles another way while a variant is traced."""
    from transformer_zoo.models import blockwise_tiles as bt

    library = bt._corner_parts

    def parts(cfg, kind):
        if kind != bt.NESTED:
            return library(cfg, kind)
        if split == "halves":
            return library(cfg, bt.CORNER)
        q, k = cfg.block_q // 4, cfg.block_kv // 4
        return tuple(bt._Part(r * q, (r + 1) * q, 0, (r + 1) * k) for r in range(4))

    if split is not None:
        bt._corner_parts = parts
    try:
        yield
    finally:
        bt._corner_parts = library


def worker(n: int, names: list[str], runs: int) -> dict:
    """Best seconds of every named variant, compiled side by side and timed by turns."""
    import functools

    from transformer_zoo.models.blockwise import blockwise_attention

    qkv = attention_inputs(n)
    calls = {}
    for name in names:
        kind, tile, split = VARIANTS[name]
        fn = functools.partial(blockwise_attention, mask=_mask(kind, n), block_q=tile,
                               block_kv=tile)
        with _diagonal_split(split):
            calls[name] = (compiled_grad(fn, qkv), qkv)
        timed(calls[name][0], *qkv)  # the first call (untimed: it may allocate)
    return best_by_turns(calls, runs)


def _run(n: int, names, runs: int, xla_flags: str | None = None) -> dict:
    env = dict(os.environ)
    if xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    cmd = [sys.executable, __file__, "--worker", "--n", str(n), "--runs", str(runs),
           "--names", json.dumps(list(names))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(n: int, best: dict, ynn_off: dict) -> str:
    base = best["no mask"]
    lines = ["| variant | time (s) | no mask / variant |", "|---|---|---|"]
    lines += [f"| {name} | {t:.3f} | {base / t:.2f}x |" for name, t in best.items()]
    nt = n // TILE
    whole = nt * (nt - 1) // 2
    tile = base / nt**2
    diagonal = (best["causal"] - best["whole tiles only (no diagonal)"]) / nt
    lines += ["", f"{nt} x {nt} tiles of {TILE}: a whole tile {1e3 * tile:.1f} ms (no mask / "
              f"{nt * nt}); a diagonal tile {1e3 * diagonal:.1f} ms = {diagonal / tile:.2f} of it "
              f"((causal - whole tiles only) / {nt}); bound with no other cost: "
              f"{nt * nt} / ({whole} + {nt} x {diagonal / tile:.2f}) = "
              f"{nt * nt / (whole + nt * diagonal / tile):.2f}x"]
    off = ynn_off
    lines += ["", f"YNNPACK fusion off ({YNN_OFF}), one process: no mask {off['no mask']:.3f} s, "
              f"causal at 256 tiles {off['causal, 256 tiles']:.3f} s: "
              f"{off['no mask'] / off['causal, 256 tiles']:.2f}x"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--names", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.n % 1024:
        parser.error(f"--n must be a multiple of 1024 (the largest tile), got {args.n}")
    if args.worker:
        print(json.dumps(worker(args.n, json.loads(args.names), args.runs)))
        return
    best = _run(args.n, VARIANTS, args.runs)
    ynn_off = _run(args.n, YNN_OFF_VARIANTS, args.runs, YNN_OFF)
    import jax

    print(f"N={args.n}, B=1, {HEADS} heads, head dim {HEAD_DIM}, float32, fwd+bwd; "
          f"jax {jax.__version__}, {len(os.sched_getaffinity(0))} cores; best of {args.runs}")
    print(report(args.n, best, ynn_off))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

"""The output layer's options: chunked loss (train.loss_chunks) and target-side vocabulary.

    python benchmarks/loss_chunks.py [--chunks 0,4,8,16] [--output_vocab all] [--steps 40]

The model and batch are the Multi30k recipe's (configs/multi30k.py): encoder-
decoder, D 128, 4 heads, F 256, 4 + 4 layers, post-norm, tied joint vocabulary
of 8000, residual dropout 0.2, label smoothing 0.1, the XLA:CPU layer on, and
a packed batch of 64 rows x 64 source and 64 target tokens (sentence-like
segments of 10-23 tokens). One subprocess, with the training CLI's malloc
environment (train/host_memory.py), compiles a step per `--chunks` value and
runs them in turn, one step each, so that a slow spell of a shared machine
falls on all; each row gives the median step time after 3 warm-up steps, its
speed against the first value (the median over steps of the paired ratio
first / this), and the loss after its steps (the same batch each step), which
the chunked loss should match to float32 rounding. The peak RSS comes from a
separate process per value that runs only that value's step.

`--output_vocab all,target_side` also steps each chunk value with the model's
output_ids set to the size of Multi30k's target side (data.output_vocab=
'target_side': 5481 of the 8000 ids, here a fixed random set with EOS), the
softmax and the output layer over those alone. The batch's tokens are then drawn
from that set for every row (so all rows step the same batch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

ROWS, LENGTH, VOCAB, WARMUP_STEPS = 64, 64, 8000, 3
TARGET_SIDE = 5481  # Multi30k en -> de: pieces of the German training targets (+ EOS, UNK)


def target_side_ids() -> tuple[int, ...]:
    """A fixed set of TARGET_SIDE ids with EOS (1), ascending."""
    rest = np.random.default_rng(7).choice(np.arange(2, VOCAB), TARGET_SIDE - 1, replace=False)
    return tuple(sorted({1, *rest.tolist()}))


def compiled_steps(variants: list[tuple[int, str]]) -> tuple[list, list, dict]:
    """One compiled train step and one fresh state per (loss_chunks, output_vocab), and
    the batch (tokens of the target side if any variant keeps only those)."""
    import jax

    from transformer_zoo import models
    from transformer_zoo.configs import common
    from transformer_zoo.train.state import create_train_state, make_optimizer
    from transformer_zoo.train.step import make_train_step

    cfg = models.ModelConfig(vocab_size=VOCAB, d_model=128, num_heads=4, d_ff=256,
                             num_encoder_layers=4, num_decoder_layers=4, dropout_rate=0.2,
                             max_length=256, kernels="cpu")
    restricted = cfg.replace(output_ids=target_side_ids())
    model = models.EncoderDecoder(cfg)
    tx, schedule = make_optimizer(common.base_config().optim, cfg.d_model, 100_000)
    batch = packed_batch(restricted.output_ids if any(v == "target_side" for _, v in variants)
                         else None)
    params = jax.jit(model.init)(jax.random.key(0), batch["inputs"], batch["targets"])["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params,
                          is_leaf=lambda x: hasattr(x, "value"))
    steps, states = [], []
    for chunks, vocab in variants:
        step_model = models.EncoderDecoder(restricted if vocab == "target_side" else cfg)
        step = jax.jit(make_train_step(step_model, "encoder_decoder", 0.1, schedule,
                                       loss_chunks=chunks), donate_argnums=0)
        states.append(create_train_state(jax.tree.map(lambda x: x.copy(), params), tx, 0))
        steps.append(step.lower(states[-1], batch).compile())
    return steps, states, batch


def alternated(variants: list[tuple[int, str]], steps: int) -> list[dict]:
    """Step times of each variant, one step of each in turn (a slow spell hits all)."""
    compiled, states, batch = compiled_steps(variants)
    times = [[] for _ in variants]
    losses = [0.0] * len(variants)
    for i in range(WARMUP_STEPS + steps):
        for k, step in enumerate(compiled):
            start = time.perf_counter()
            states[k], metrics = step(states[k], batch)
            losses[k] = float(metrics["loss"])  # blocks: the step is done
            if i >= WARMUP_STEPS:
                times[k].append(time.perf_counter() - start)
    return [{"loss_chunks": c, "output_vocab": v, "times": t, "last_loss": loss,
             "tokens": float(metrics["tokens"])}
            for (c, v), t, loss in zip(variants, times, losses, strict=True)]


def peak_rss(variant: tuple[int, str]) -> dict:
    """Peak RSS of a process that compiles and runs only this variant's step."""
    compiled, states, batch = compiled_steps([variant])
    for _ in range(WARMUP_STEPS):
        states[0], metrics = compiled[0](states[0], batch)
        float(metrics["loss"])
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def packed_batch(ids: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
    """64 rows of back-to-back segments of 10-23 tokens, the last one cut at the row end;
    tokens drawn from `ids` (default: 4..VOCAB-1)."""
    rng = np.random.default_rng(1)
    seg = np.zeros((ROWS, LENGTH), np.int32)
    pos = np.zeros((ROWS, LENGTH), np.int32)
    for row in range(ROWS):
        start, segment = 0, 1
        while start < LENGTH - 4:
            n = min(int(rng.integers(10, 24)), LENGTH - start)
            seg[row, start:start + n] = segment
            pos[row, start:start + n] = np.arange(n)
            start, segment = start + n, segment + 1

    def tokens():
        drawn = (rng.integers(4, VOCAB, (ROWS, LENGTH)) if ids is None
                 else rng.choice(np.asarray(ids[1:]), (ROWS, LENGTH)))  # no EOS inside
        return np.where(seg > 0, drawn, 0).astype(np.int32)

    return {"inputs": tokens(), "targets": tokens(), "inputs_segmentation": seg,
            "targets_segmentation": seg, "inputs_position": pos, "targets_position": pos}


def _child(args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env={**os.environ, **env}, check=False)
    if out.returncode:
        sys.exit(f"worker {args} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="0,4,8,16",
                        help="comma-separated train.loss_chunks values; the first is the "
                             "reference (0 = logits stored)")
    parser.add_argument("--output_vocab", default="all",
                        help="comma-separated data.output_vocab values (all, target_side), "
                             "each stepped with every --chunks value")
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps of each value (after 3 warm-up), alternated")
    parser.add_argument("--worker", choices=("time", "rss"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks takes comma-separated integers, got {args.chunks!r}")
    if any(c < 0 for c in chunks):
        parser.error(f"--chunks values must be >= 0, got {chunks}")
    vocabs = args.output_vocab.split(",")
    if not set(vocabs) <= {"all", "target_side"}:
        parser.error(f"--output_vocab values are all or target_side, got {args.output_vocab!r}")
    variants = [(c, v) for v in vocabs for c in chunks]
    if args.steps < 5:
        parser.error(f"--steps must be >= 5, got {args.steps}")
    if args.worker == "time":
        print(json.dumps(alternated(variants, args.steps)))
        return
    if args.worker == "rss":
        print(json.dumps(peak_rss(variants[0])))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_step import _malloc_env  # benchmarks/train_step.py, beside this script

    env = _malloc_env(False)
    rows = _child(["--worker", "time", "--chunks", args.chunks, "--output_vocab",
                   args.output_vocab, "--steps", str(args.steps)], env)
    for row in rows:
        row.update(_child(["--worker", "rss", "--chunks", str(row["loss_chunks"]),
                           "--output_vocab", row["output_vocab"]], env))
    _print(rows)


def _print(rows: list[dict]) -> None:
    reference = rows[0]["times"]
    print(f"target tokens per step: {rows[0]['tokens']:.0f} of {ROWS * LENGTH}")
    print("| train.loss_chunks | data.output_vocab | ms/step median (min-max) | speed vs the "
          "first (median of paired ratios) | peak RSS MiB | loss after the steps |")
    print("|" + " --- |" * 6)
    for row in rows:
        times = row["times"]
        paired = statistics.median(r / t for r, t in zip(reference, times, strict=True))
        print(f"| {row['loss_chunks']} | {row['output_vocab']} "
              f"| {1e3 * statistics.median(times):.1f} "
              f"({1e3 * min(times):.1f}-{1e3 * max(times):.1f}) | {paired:.2f}x "
              f"| {row['peak_rss_mib']:.0f} | {row['last_loss']:.5f} |")


if __name__ == "__main__":
    main()

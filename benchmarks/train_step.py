"""Training-step speed: ours (jit) against PyTorch eager, and MFU against a measured peak.

    python benchmarks/train_step.py [--steps 30] [--rounds 2] [--no-torch]
                                    [--kernels cpu,portable]

The fixed comparison model: encoder-decoder, shared vocabulary 8192, D 256,
4 heads, F 1024, 3 + 3 layers, post-norm, sinusoidal positions, tied
embeddings, dropout 0.1 at torch.nn.Transformer's sites (sublayer outputs,
attention weights, FFN hidden; plus the embeddings), label smoothing 0.1,
Adam (0.9, 0.98, 1e-9), float32; batch 32 pairs x 32 source x 32 target tokens
(no padding). Each framework runs in its own subprocess (a clean peak RSS, no
shared thread pools). The peak is the best 2048^3 float32 matmul of the run
(benchmarks/matmul_peak.py): sampled at the start and by every worker before
and after its steps, so alternated with them; an MFU above 100% is refused as
a peak measured on a busy machine. The two alternate for --rounds rounds (ours,
torch, ours, torch, ...), so that a slow spell of a shared machine falls on
both; each row pools its rounds' step times, and ours/torch is also printed
per round. Both workers run with the malloc environment of `python -m transformer_zoo.train`
(train/host_memory.py: glibc's huge-page tunable, so XLA's per-step buffers
are not faulted in 4 KiB at a time); --system-malloc runs them without it.
Ours runs with the models' XLA:CPU layer (kernels=cpu, as `python -m transformer_zoo.train`
does on CPU); `--kernels cpu,portable` also times the portable default in each
round, to show what the layer buys.

MFU = (6 * non-embedding params incl. the output projection * target tokens
       + attention matmul FLOPs) / step time / peak.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matmul_peak  # benchmarks/matmul_peak.py, beside this script
import numpy as np

BATCH, SRC_LEN, TGT_LEN, VOCAB = 32, 32, 32, 8192
D_MODEL, HEADS, D_FF, LAYERS, DROPOUT, SMOOTHING = 256, 4, 1024, 3, 0.1, 0.1
WARMUP_STEPS = 3


def model_flops(non_embedding_params: int) -> float:
    """FLOPs of one step by the MFU formula (forward + backward = 3x forward)."""
    dense = 6 * non_embedding_params * BATCH * TGT_LEN
    # QK^T and AV, 2 FLOPs per multiply-add: encoder self, decoder self and cross.
    pairs = LAYERS * (SRC_LEN * SRC_LEN + TGT_LEN * TGT_LEN + TGT_LEN * SRC_LEN)
    attention = 3 * 2 * 2 * BATCH * D_MODEL * pairs
    return dense + attention


# ---------------------------------------------------------------- ours


def run_jax(steps: int, kernels: str = "cpu") -> dict:
    import jax

    from transformer_zoo import models
    from transformer_zoo.configs import common
    from transformer_zoo.train.state import create_train_state, make_optimizer
    from transformer_zoo.train.step import make_train_step

    cfg = models.ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF,
                             num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                             dropout_rate=DROPOUT, attention_dropout_rate=DROPOUT,
                             activation_dropout_rate=DROPOUT, max_length=64,
                             kernels=kernels)
    model = models.EncoderDecoder(cfg)
    optim = common.base_config().optim  # the paper's Adam and warmup schedule
    tx, schedule = make_optimizer(optim, D_MODEL, 100_000)
    batch = _batch()
    params = jax.jit(model.init)(jax.random.key(0), batch["inputs"], batch["targets"])["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params,
                          is_leaf=lambda x: hasattr(x, "value"))
    state = create_train_state(params, tx, 0)
    step_fn = jax.jit(make_train_step(model, "encoder_decoder", SMOOTHING, schedule),
                      donate_argnums=0)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    times, losses = [], []
    for i in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # blocks: the step is done
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    embed = params["target_embed"]["embedding"].size  # shared by encoder, decoder and output
    total = sum(x.size for x in jax.tree.leaves(params))
    return _summary(f"ours (jax.jit, kernels={kernels})", times, compile_s, losses,
                    non_embedding=total - embed + D_MODEL * VOCAB, total_params=total)


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    ones = np.ones((BATCH, SRC_LEN), np.int32)
    pos = np.broadcast_to(np.arange(SRC_LEN, dtype=np.int32), ones.shape)
    return {"inputs": rng.integers(4, VOCAB, (BATCH, SRC_LEN), dtype=np.int32),
            "targets": rng.integers(4, VOCAB, (BATCH, TGT_LEN), dtype=np.int32),
            "inputs_segmentation": ones, "targets_segmentation": ones,
            "inputs_position": pos, "targets_position": pos}


# ---------------------------------------------------------------- PyTorch eager


def run_torch(steps: int) -> dict:
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.register_buffer("table", _sinusoids(64, D_MODEL))
            self.drop = nn.Dropout(DROPOUT)
            self.transformer = nn.Transformer(
                d_model=D_MODEL, nhead=HEADS, num_encoder_layers=LAYERS,
                num_decoder_layers=LAYERS, dim_feedforward=D_FF, dropout=DROPOUT,
                batch_first=True)
            self.out = nn.Linear(D_MODEL, VOCAB)
            self.out.weight = self.embed.weight  # tied, as ours
            nn.init.normal_(self.embed.weight, std=D_MODEL**-0.5)  # our initialiser

        def _embed(self, ids):
            x = self.embed(ids) * math.sqrt(D_MODEL) + self.table[: ids.shape[1]]
            return self.drop(x)

        def forward(self, src, tgt_in):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
            h = self.transformer(self._embed(src), self._embed(tgt_in), tgt_mask=mask,
                                 tgt_is_causal=True)
            return self.out(h)

    model = Seq2Seq().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=SMOOTHING)
    b = _batch()
    src, tgt = torch.from_numpy(b["inputs"]).long(), torch.from_numpy(b["targets"]).long()
    tgt_in = torch.cat([torch.full((BATCH, 1), 2), tgt[:, :-1]], dim=1)
    times, losses = [], []
    for i in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(src, tgt_in).reshape(-1, VOCAB), tgt.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    total = sum(p.numel() for p in model.parameters())
    return _summary(f"PyTorch {torch.__version__} eager", times, 0.0, losses,
                    non_embedding=total - VOCAB * D_MODEL + D_MODEL * VOCAB, total_params=total)


def _sinusoids(length: int, d: int):
    import torch

    pos = np.arange(length)[:, None]
    rates = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    table = np.zeros((length, d), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(pos * rates), np.cos(pos * rates)
    return torch.from_numpy(table)


# ---------------------------------------------------------------- report


def _summary(name, times, compile_s, losses, *, non_embedding, total_params) -> dict:
    median = statistics.median(times)
    return {"name": name, "ms_median": 1e3 * median, "ms_min": 1e3 * min(times),
            "ms_max": 1e3 * max(times), "tokens_per_s": BATCH * TGT_LEN / median,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "compile_s": compile_s, "first_loss": losses[0], "last_loss": losses[-1],
            "times": list(times),
            "non_embedding_params": non_embedding, "params": total_params, "steps": len(times)}


def _child(framework: str, steps: int, malloc_env: dict[str, str], kernels: str = "cpu") -> dict:
    cmd = [sys.executable, __file__, "--worker", framework, "--steps", str(steps),
           "--kernels", kernels]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **malloc_env)
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{framework} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after 3 warm-up)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating ours/torch subprocess rounds (pooled)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--system-malloc", action="store_true",
                        help="run the workers without the training CLI's malloc environment")
    parser.add_argument("--kernels", default="cpu",
                        help="comma-separated models.Kernels values for ours: cpu (the CLIs' "
                             "choice on CPU), portable, or both")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    if not kernels or any(k not in ("cpu", "portable") for k in kernels):
        parser.error(f"--kernels takes cpu and/or portable, got {args.kernels!r}")
    if args.steps < 20:
        parser.error(f"--steps must be >= 20 for a median, got {args.steps}")
    if args.worker:
        worker = (lambda steps: run_jax(steps, kernels[0])) if args.worker == "jax" else run_torch
        peaks = matmul_peak.sample()
        result = worker(args.steps)
        result["peaks"] = peaks + matmul_peak.sample()
        print(json.dumps(result))
        return
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    peak = matmul_peak.Peak()
    peak.add(matmul_peak.sample(repeats=5))
    frameworks = [("jax", k) for k in kernels]
    if not args.no_torch:
        try:
            import torch  # noqa: F401
            frameworks.append(("torch", "cpu"))
        except ImportError:
            print("(PyTorch not installed: pip install -e '.[benchmark]' for the reference)")
    malloc_env = _malloc_env(args.system_malloc)
    rounds = [[_child(f, args.steps, malloc_env, k) for f, k in frameworks]
              for _ in range(args.rounds)]
    for result in (r for round_ in rounds for r in round_):
        peak.add(result.pop("peaks"))
    _print([_pool([r[i] for r in rounds]) for i in range(len(frameworks))], peak)
    if frameworks[-1][0] == "torch":
        ratios = ", ".join(f"{r[0]['tokens_per_s'] / r[-1]['tokens_per_s']:.2f}x" for r in rounds)
        print(f"ours / torch per round: {ratios}")


def _malloc_env(system_malloc: bool) -> dict[str, str]:
    """The workers' malloc environment (python -m transformer_zoo.train's unless told otherwise)."""
    from transformer_zoo.train.host_memory import huge_page_env

    env = {} if system_malloc else huge_page_env()
    described = " ".join(f"{k}={v}" for k, v in env.items()) or "unchanged"
    print(f"worker malloc environment: {described}")
    return env


def _pool(results: list[dict]) -> dict:
    """One row from several rounds of one framework: statistics over all their steps."""
    times = [t for r in results for t in r["times"]]
    row = dict(results[0], times=times, steps=len(times))
    median = statistics.median(times)
    row.update(ms_median=1e3 * median, ms_min=1e3 * min(times), ms_max=1e3 * max(times),
               tokens_per_s=BATCH * TGT_LEN / median,
               peak_rss_mib=max(r["peak_rss_mib"] for r in results),
               compile_s=statistics.median(r["compile_s"] for r in results))
    return row


def _print(rows: list[dict], peak) -> None:
    print(peak.describe())
    ours = rows[0]
    print(f"model FLOPs/step: {model_flops(ours['non_embedding_params']) / 1e9:.2f} G "
          f"({ours['non_embedding_params'] / 1e6:.2f}M non-embedding params incl. output)")
    head = ("| implementation | ms/step median (min-max) | target tok/s | vs ours | MFU "
            "| peak RSS MiB | compile s | loss first -> last |")
    print(head)
    print("|" + " --- |" * 8)
    for r in rows:
        mfu = peak.mfu(model_flops(r["non_embedding_params"]) / (r["ms_median"] / 1e3))
        print(f"| {r['name']} | {r['ms_median']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) "
              f"| {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ours['tokens_per_s']:.2f}x "
              f"| {100 * mfu:.1f}% | {r['peak_rss_mib']:.0f} | {r['compile_s']:.1f} "
              f"| {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    if rows[-1]["name"].startswith("PyTorch"):
        print(f"ours / torch tokens/s: {ours['tokens_per_s'] / rows[-1]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()

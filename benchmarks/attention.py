"""Attention at scale: forward+backward time and peak memory against a reference.

    python benchmarks/attention.py            # N = 512 ... 32768 (about 10-15 min on CPU)
    python benchmarks/attention.py --max-n 2048   # quick look

For each sequence length N (B=1, 8 heads, head dim 64, float32, no mask) it
times jax.grad of sum(attention(q, k, v)) w.r.t. q, k, v for
`jax.nn.dot_product_attention` (the outside reference) and this package's
`blockwise`, `local` (causal, window 512) and `linear` (causal)
implementations, each (impl, N) in a fresh subprocess. Memory is reported two
ways: the peak resident set (ru_maxrss) of that subprocess minus the peak of
a baseline subprocess that only imports jax and builds the same inputs, and
XLA's compiled memory_analysis() temp bytes (scratch beyond inputs/outputs).
The reference is skipped where its three [8, N, N] float32 buffers
(3 * N^2 * 8 * 4 bytes) would pass ~20 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HEADS, HEAD_DIM = 8, 64
REFERENCE_LIMIT_GIB = 20.0
LOCAL_WINDOW = 512
GIB, MIB = 2**30, 2**20
IMPLS = ("reference", "blockwise", "local", "linear")


def _attention_fn(impl: str, n: int):
    """The attention callable of `impl` for inputs of length n."""
    import jax

    from transformer_zoo.models import blockwise, linear_attention, local_attention
    from transformer_zoo.models.masks import make_attention_mask

    if impl == "reference":
        return jax.nn.dot_product_attention
    if impl == "blockwise":
        return blockwise.blockwise_attention
    causal = make_attention_mask(None, q_len=n, causal=True, window=LOCAL_WINDOW)
    if impl == "local":
        return lambda q, k, v: local_attention.local_attention(q, k, v, mask=causal)
    causal = causal.replace(window=None)
    return lambda q, k, v: linear_attention.linear_attention(q, k, v, mask=causal)


def _repeats(n: int) -> int:
    return 3 if n <= 4096 else 2 if n <= 8192 else 1


def worker(impl: str, n: int) -> dict:
    """Runs in a fresh process: compiles, times and measures one (impl, N)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, n, HEADS, HEAD_DIM), jnp.float32) for key in keys)
    jax.block_until_ready((q, k, v))
    if impl == "baseline":
        return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    fn = _attention_fn(impl, n)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    if n <= 8192:  # warm-up; at larger N the AOT-compiled first call is representative
        jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(_repeats(n)):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time": sorted(times)[len(times) // 2], "rss": rss, "temp": temp}


def _run_worker(impl: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, "--n", str(n)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predicted_reference_gib(n: int) -> float:
    """Scores, weights and their cotangent: 3 * [8, N, N] float32."""
    return 3 * n * n * HEADS * 4 / GIB


def measure(ns: list[int]) -> dict:
    """{(impl, N): result} for every impl and N, printing progress."""
    results = {}
    for n in ns:
        base = _run_worker("baseline", n)["rss"]
        for impl in IMPLS:
            gib = predicted_reference_gib(n)
            if impl == "reference" and gib > REFERENCE_LIMIT_GIB:
                results[impl, n] = {"error": f"OOM (predicted {gib:.0f} GiB)"}
                continue
            res = _run_worker(impl, n)
            if "rss" in res:
                res["mem"] = max(res["rss"] - base, 0)
            results[impl, n] = res
            print(f"  N={n} {impl}: {res}", file=sys.stderr, flush=True)
    return results


def _cell_time(res: dict) -> str:
    return res.get("error") or f"{res['time']:.3f}"


def _cell_mem(res: dict) -> str:
    return res.get("error") or f"{res['mem'] / MIB:.0f} / {res['temp'] / MIB:.0f}"


def _ratio(res: dict, ref: dict, field: str) -> str:
    if "error" in res or "error" in ref or not ref[field]:
        return "-"
    return f"{res[field] / ref[field]:.2f}"


def table(results: dict, ns: list[int]) -> str:
    """Markdown table: times (s), memory (RSS delta / XLA temp, MiB), ratios."""
    head = ["N"] + [f"{i} time (s)" for i in IMPLS] + [f"{i} mem (MiB)" for i in IMPLS]
    head += ["blockwise/ref time", "blockwise/ref RSS", "blockwise/ref temp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in ns:
        row = [str(n)] + [_cell_time(results[i, n]) for i in IMPLS]
        row += [_cell_mem(results[i, n]) for i in IMPLS]
        bw, ref = results["blockwise", n], results["reference", n]
        row += [_ratio(bw, ref, "time"), _ratio(bw, ref, "mem"), _ratio(bw, ref, "temp")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=int, default=32768)
    parser.add_argument("--worker", choices=("baseline",) + IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n)))
        return
    ns = [n for n in (512 * 2**i for i in range(7)) if n <= args.max_n]
    start = time.perf_counter()
    results = measure(ns)
    print(f"B=1, {HEADS} heads, head dim {HEAD_DIM}, float32, fwd+bwd; "
          f"jax {__import__('jax').__version__}, {os.cpu_count()} CPUs; "
          f"local: causal window {LOCAL_WINDOW}; linear: causal")
    print("mem = peak RSS minus a baseline process's / XLA memory_analysis temp bytes")
    print(table(results, ns))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

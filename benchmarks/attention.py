"""Attention at scale: forward+backward time, share of the matmul peak and memory.

    python benchmarks/attention.py --max-n 16384   # N = 512 ... 16384 (~6 min on 2 cores)
    python benchmarks/attention.py                 # up to N = 32768
    python benchmarks/attention.py --max-n 2048    # quick look
    python benchmarks/attention.py --max-n 16384 --rounds 2   # each cell the best of 2 sweeps

For each sequence length N (B=1, 8 heads, head dim 64, float32) it times
jax.grad of sum(attention(q, k, v)) w.r.t. q, k, v for
`jax.nn.dot_product_attention` (the outside reference, without and with
is_causal) and this package's `blockwise` (without and with a causal mask),
`local` (causal, window 512) and `linear` (causal) implementations, each
(impl, N) in a fresh subprocess. A cell's time is the best of its timed runs,
and with --rounds R the whole sweep runs R times and each cell keeps its best:
other processes on the machine only ever add time, and the peak it is divided
by is a best-of too.

The causal speed-up (blockwise no-mask time / causal time) comes from a
separate process per N that compiles both and times them by turns, so load
from elsewhere on the machine falls on both sides of the ratio. Up to
N = 4096 that process also times the reference (without and with is_causal)
by turns with them, and the blockwise / reference ratios come from it.

"% of peak" is useful FLOPs / time / the fp32 matmul peak
(benchmarks/matmul_peak.py: every worker samples a 2048^3 matmul before and
after its timing runs, and the run divides by its best sample). Useful FLOPs
are the 7 N x N x 64 matmuls per head of a forward and backward pass with
recomputed scores (2 forward, 5 backward): 14 * N^2 * 64 * 8; a causal mask
counts half of that.

Memory is reported two ways: the peak resident set (ru_maxrss) of that
subprocess minus the peak of a baseline subprocess that only imports jax and
builds the same inputs, and XLA's compiled memory_analysis() temp bytes
(scratch beyond inputs/outputs). The reference is skipped where its three
[8, N, N] float32 buffers (3 * N^2 * 8 * 4 bytes) would pass ~20 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from by_turns import HEAD_DIM, HEADS, attention_inputs, best_by_turns, compiled_grad, timed

REFERENCE_LIMIT_GIB = 20.0
LOCAL_WINDOW = 512
GIB, MIB = 2**30, 2**20
IMPLS = ("reference", "reference_causal", "blockwise", "blockwise_causal", "local", "linear")
CAUSAL = {"reference_causal", "blockwise_causal"}
PAIR = ("blockwise", "blockwise_causal")  # timed by turns in one process (pair_worker)
# ... with the reference up to this N (its runs take seconds beyond).
PAIR_REFERENCE_MAX_N = 4096


def _attention_fn(impl: str, n: int):
    """The attention callable of `impl` for inputs of length n."""
    import functools

    import jax

    from transformer_zoo.models import blockwise, linear_attention, local_attention
    from transformer_zoo.models.masks import make_attention_mask

    if impl == "reference":
        return jax.nn.dot_product_attention
    if impl == "reference_causal":
        return functools.partial(jax.nn.dot_product_attention, is_causal=True)
    if impl == "blockwise":
        return blockwise.blockwise_attention
    if impl == "blockwise_causal":
        mask = make_attention_mask(None, q_len=n, causal=True)
        return functools.partial(blockwise.blockwise_attention, mask=mask)
    causal = make_attention_mask(None, q_len=n, causal=True, window=LOCAL_WINDOW)
    if impl == "local":
        return lambda q, k, v: local_attention.local_attention(q, k, v, mask=causal)
    causal = causal.replace(window=None)
    return lambda q, k, v: linear_attention.linear_attention(q, k, v, mask=causal)


def _repeats(n: int) -> int:
    """Timed runs (the best is reported): many where a run takes milliseconds."""
    return 15 if n <= 1024 else 7 if n <= 4096 else 3 if n <= 8192 else 2


def useful_flops(impl: str, n: int) -> float:
    """The matmul FLOPs of one forward + backward pass (half of them when causal)."""
    return 14 * n * n * HEAD_DIM * HEADS * (0.5 if impl in CAUSAL else 1.0)


def worker(impl: str, n: int) -> dict:
    """Runs in a fresh process: compiles, times and measures one (impl, N)."""
    import matmul_peak

    qkv = attention_inputs(n)
    if impl == "baseline":
        return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    compiled = compiled_grad(_attention_fn(impl, n), qkv)
    temp = compiled.memory_analysis().temp_size_in_bytes
    peaks = matmul_peak.sample()
    if n <= 8192:  # at larger N the AOT-compiled first call is representative
        _warm_up(compiled, qkv)
    times = [timed(compiled, *qkv) for _ in range(_repeats(n))]
    peaks += matmul_peak.sample()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time": min(times), "median": sorted(times)[len(times) // 2], "rss": rss,
            "temp": temp, "peaks": peaks}


def _pair_impls(n: int) -> tuple[str, ...]:
    """The impls `pair_worker` times by turns at length n."""
    return PAIR + (("reference", "reference_causal") if n <= PAIR_REFERENCE_MAX_N else ())


def pair_worker(n: int) -> dict:
    """Blockwise without and with the causal mask (and the reference) in one process, by turns.

    The causal speed-up is a ratio of two times; timed in separate processes
    minutes apart, other load on the machine lands on one of them and not the
    other. Here they are compiled side by side and their runs alternate, so a
    busy spell slows all of them (each keeps its best run). The same holds
    for blockwise / reference, where the reference is cheap enough to repeat.
    """
    qkv = attention_inputs(n)
    compiled = {impl: compiled_grad(_attention_fn(impl, n), qkv) for impl in _pair_impls(n)}
    if n <= 8192:  # as in `worker`
        for c in compiled.values():
            _warm_up(c, qkv)
    return best_by_turns({impl: (c, qkv) for impl, c in compiled.items()}, _repeats(n))


def _warm_up(compiled, args, seconds: float = 0.3) -> None:
    """Calls `compiled` for at least `seconds` (once at least) before it is timed.

    After the peak's numpy matmuls, BLAS threads spin for a while before they
    sleep; a short warm-up keeps them off the cores while the first timed runs
    of a millisecond-scale problem run.
    """
    start = time.perf_counter()
    while True:
        timed(compiled, *args)
        if time.perf_counter() - start >= seconds:
            return


def _run_worker(impl: str, n: int, root: str | None = None) -> dict:
    """One (impl, N) in a fresh process; `root` puts another checkout's package first."""
    cmd = [sys.executable, __file__, "--worker", impl, "--n", str(n)]
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.pathsep.join([root] + env.get("PYTHONPATH", "").split(os.pathsep))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predicted_reference_gib(n: int) -> float:
    """Scores, weights and their cotangent: 3 * [8, N, N] float32."""
    return 3 * n * n * HEADS * 4 / GIB


def measure(ns: list[int], peak, baseline_root: str | None = None, rounds: int = 1) -> dict:
    """{(impl, N): result} for every impl and N, printing progress; samples go to `peak`.

    With `baseline_root`, each blockwise (impl, N) also runs from that package
    root, right after ours (alternated), as (impl + " before", N). The sweep
    runs `rounds` times; a cell keeps its best time and its largest memory.
    """
    results = {}
    for _ in range(rounds):
        for key, res in _sweep(ns, peak, baseline_root).items():
            results[key] = _better(key, results.get(key), res)
    return results


def _better(key: tuple, old: dict | None, new: dict) -> dict:
    """The faster of two results of one cell, with the larger of their memory figures.

    A ("pair", N) cell keeps each of its impls' best time.
    """
    if old is None or "error" in old:
        return new
    if "error" in new:
        return old
    if key[0] == "pair":
        return {impl: min(old[impl], new[impl]) for impl in old}
    best = dict(min(old, new, key=lambda r: r["time"]))
    for field in ("mem", "rss", "temp"):
        best[field] = max(old[field], new[field])
    return best


def _sweep(ns: list[int], peak, baseline_root: str | None) -> dict:
    """One pass of `measure` over every N and impl."""
    results = {}
    for n in ns:
        base = _run_worker("baseline", n)["rss"]
        for impl in IMPLS:
            gib = predicted_reference_gib(n)
            if impl.startswith("reference") and gib > REFERENCE_LIMIT_GIB:
                results[impl, n] = {"error": f"OOM (predicted {gib:.0f} GiB)"}
                continue
            runs = [(impl, None)]
            if baseline_root and impl.startswith("blockwise"):
                runs.append((impl + " before", baseline_root))
            for name, root in runs:
                res = _run_worker(impl, n, root)
                if "rss" in res:
                    res["mem"] = max(res["rss"] - base, 0)
                    peak.add(res.pop("peaks"))
                results[name, n] = res
                print(f"  N={n} {name}: {res}", file=sys.stderr, flush=True)
        results["pair", n] = _run_worker("pair", n)
        print(f"  N={n} pair: {results['pair', n]}", file=sys.stderr, flush=True)
    return results


def before_after_table(results: dict, ns: list[int]) -> str:
    """Markdown table: blockwise time before / after the change, and the speed-up."""
    head = ["N", "no mask before (s)", "no mask after (s)", "speed-up",
            "causal before (s)", "causal after (s)", "speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in ns:
        row = [str(n)]
        for impl in ("blockwise", "blockwise_causal"):
            old, new = results[impl + " before", n], results[impl, n]
            row += [_cell_time(old), _cell_time(new), _ratio(old, new, "time")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _cell_time(res: dict) -> str:
    return res.get("error") or f"{res['time']:.3f}"


def _cell_mem(res: dict) -> str:
    return res.get("error") or f"{res['mem'] / MIB:.0f} / {res['temp'] / MIB:.0f}"


def _ratio(res: dict, ref: dict, field: str) -> str:
    if "error" in res or "error" in ref or not ref[field]:
        return "-"
    return f"{res[field] / ref[field]:.2f}"


def _speed_up(pair: dict) -> str:
    if "error" in pair:
        return "-"
    return f"{pair['blockwise'] / pair['blockwise_causal']:.2f}x"


def _vs_reference(results: dict, impl: str, ref: str, n: int) -> str:
    """impl / ref time: by turns in the pair process where it timed both, else across cells."""
    pair = results["pair", n]
    if "error" not in pair and ref in pair:
        return f"{pair[impl] / pair[ref]:.2f}"
    return _ratio(results[impl, n], results[ref, n], "time")


def _share(results: dict, impl: str, n: int, peak) -> str:
    res = results[impl, n]
    if "error" in res:
        return "-"
    return f"{100 * peak.mfu(useful_flops(impl, n) / res['time']):.0f}%"


def table(results: dict, ns: list[int], peak) -> str:
    """Markdown table: times (s), ratios and shares of the peak."""
    head = ["N"] + [f"{i} (s)" for i in IMPLS]
    head += [f"blockwise / reference (by turns to N = {PAIR_REFERENCE_MAX_N})",
             "causal: blockwise / reference (ditto)",
             "blockwise: causal speed-up (by turns, one process)",
             "blockwise % of peak", "blockwise causal % of peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in ns:
        r = {i: results[i, n] for i in IMPLS}
        row = [str(n)] + [_cell_time(r[i]) for i in IMPLS]
        row += [_vs_reference(results, "blockwise", "reference", n),
                _vs_reference(results, "blockwise_causal", "reference_causal", n),
                _speed_up(results["pair", n]),
                _share(results, "blockwise", n, peak), _share(results, "blockwise_causal", n, peak)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def memory_table(results: dict, ns: list[int]) -> str:
    """Markdown table: memory (RSS delta / XLA temp, MiB) and blockwise / reference."""
    impls = ("reference", "blockwise", "blockwise_causal", "local", "linear")
    head = ["N"] + [f"{i} mem (MiB)" for i in impls] + ["blockwise/ref RSS", "blockwise/ref temp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in ns:
        bw, ref = results["blockwise", n], results["reference", n]
        row = [str(n)] + [_cell_mem(results[i, n]) for i in impls]
        row += [_ratio(bw, ref, "mem"), _ratio(bw, ref, "temp")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=1,
                        help="sweeps over every (impl, N); each cell keeps its best time")
    parser.add_argument("--baseline-root", help="also time blockwise from this package root "
                        "(a directory holding transformer_zoo/, e.g. links into a worktree of "
                        "the previous commit), alternated with ours: a before/after table")
    parser.add_argument("--worker", choices=("baseline", "pair") + IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run = pair_worker(args.n) if args.worker == "pair" else worker(args.worker, args.n)
        print(json.dumps(run))
        return
    import matmul_peak

    ns = [n for n in (256 * 2**i for i in range(8)) if n <= args.max_n]
    start = time.perf_counter()
    peak = matmul_peak.Peak()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    results = measure(ns, peak, args.baseline_root, args.rounds)
    print(f"B=1, {HEADS} heads, head dim {HEAD_DIM}, float32, fwd+bwd; "
          f"jax {__import__('jax').__version__}, {os.cpu_count()} CPUs; best of "
          f"{args.rounds} sweep(s); "
          f"local: causal window {LOCAL_WINDOW}; linear: causal")
    print(peak.describe())
    print(table(results, ns, peak))
    print("mem = peak RSS minus a baseline process's / XLA memory_analysis temp bytes")
    print(memory_table(results, ns))
    if args.baseline_root:
        print(f"before = {args.baseline_root}")
        print(before_after_table(results, ns))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

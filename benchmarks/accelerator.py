"""Accelerator paths on one GPU: train-step MFU, attention kernels, cached decoding, dropout.

    python benchmarks/accelerator.py [--sections train,attention,decode,dropout] [--steps 20]
                                     [--peak-tflops 989.4] [--decode-dtype float32]
    python benchmarks/accelerator.py --smoke     # tiny sizes on any device (a CPU dry run)

Needs a GPU (exits 1 with one line otherwise, unless --smoke); sized to finish
within 5 minutes on one H200-class GPU. Every ratio is against a reference
measured in the same run. A section that fails prints its traceback to stderr,
the others still run, and the exit status is 1.

* train: the portable (default, xla attention) train step of the paper's base
  preset (6 + 6 layers, D 512, 8 heads, F 2048, V 32000, dropout 0.1, bfloat16
  compute, float32 parameters), label smoothing 0.1, the paper's Adam and warmup
  (configs.common), batch 64 pairs x 128 source x 128 target tokens on the device.
  ms/step is the mean over --steps steps dispatched back to back after 3 warm-up
  steps; MFU as in benchmarks/train_step.py: (6 * non-embedding params incl. the
  output projection * target tokens + attention matmul FLOPs) / step time / peak,
  the peak being the GPU's published dense bf16 tensor FLOP/s (PEAK_BF16, matched
  on `jax.devices()[0].device_kind`; --peak-tflops overrides; unknown -> n/a).
* attention: `models.dot_product_attention(impl=...)` for cudnn and pallas against
  xla, causal (an index-aligned AttentionMask), B 4, N 16, H 64, T = S in (1024,
  4096), bfloat16. Errors are max |impl - xla in float32 at 'highest' matmul
  precision| of the output and of the gradients w.r.t. q, k, v of
  sum(output * a fixed random cotangent); time is the median of --steps jitted
  forward + backward calls. The xla row's errors are bfloat16's own. An impl that
  raises shows its one-line reason instead.
* decode: `models.generate.translate_greedy` and `translate` (beam 4, alpha 0.6)
  on a base-size EncoderDecoder with random weights, batch 32, source 32 tokens,
  max_extra 32, eos_id -1 (all 64 steps run), --decode-dtype compute (float32 by
  default, so that cached and recomputed tokens can be compared exactly); ms/step
  is the best of 3 compiled runs / 64; greedy also runs with use_cache=False
  (the full decoder over the padded prefix every step) for the speedup and the
  token equality.
* dropout: forward and forward + backward of `models.dropout(x, 0.1, key)` (the
  counter-hash masks of models/dropout.py) against threefry masks,
  `jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x / 0.9, 0)`, on a
  [64, 128, 4096] bfloat16 array; median of --steps calls. It decides whether the
  hash masks stay the portable default on GPU.

--smoke runs every section at tiny sizes (tiny preset, T 128, batch 2, 2 steps) on
whatever device exists; an impl that cannot run there prints its reason (on a CPU,
cudnn; pallas may run there in the Pallas interpreter, which says nothing of its speed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

SECTIONS = ("train", "attention", "decode", "dropout")
ATTENTION_IMPLS = ("xla", "cudnn", "pallas")  # xla first: the reference row
WARMUP_STEPS, DECODE_REPEATS, SMOOTHING = 3, 3, 0.1

# Dense (no sparsity) bf16 tensor-core FLOP/s from the vendors' datasheets, matched
# as case-insensitive substrings of device_kind, first match wins (PCIe/NVL before SXM).
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12),  # also GH200
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    preset: str
    vocab: int
    batch: int  # train pairs
    src_len: int  # train source and target length
    attn_shape: tuple[int, int, int]  # B, N, H
    attn_lengths: tuple[int, ...]  # T = S
    decode_batch: int
    decode_src: int
    max_extra: int
    dropout_shape: tuple[int, ...]
    steps: int


FULL = Sizes("base", 32000, 64, 128, (4, 16, 64), (1024, 4096), 32, 32, 32, (64, 128, 4096), 20)
SMOKE = Sizes("tiny", 128, 2, 128, (2, 4, 64), (128,), 2, 8, 8, (2, 128, 256), 2)


# ---------------------------------------------------------------- helpers


def peak_flops(kind: str, override_tflops: float | None) -> float | None:
    """The dense bf16 peak of `kind` (FLOP/s), the override, or None if unknown."""
    if override_tflops is not None:
        return override_tflops * 1e12
    return next((p for name, p in PEAK_BF16 if name.lower() in kind.lower()), None)


def _compile(jitted, *args):
    """(compiled, seconds to trace + lower + compile)."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - start


def _times(compiled, *args, repeats: int) -> list[float]:
    """Wall seconds of `repeats` blocking calls, after one untimed call."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return times


def _reason(exc: BaseException) -> str:
    """One table-safe line saying why a call failed."""
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    text = ": ".join([type(exc).__name__, *lines[:1]]).replace("|", "/")
    return text if len(text) <= 160 else text[:157] + "..."


def _unboxed_params(model, *example):
    params = jax.jit(model.init)(jax.random.key(0), *example)["params"]
    return jax.tree.map(lambda x: getattr(x, "value", x), params,
                        is_leaf=lambda x: hasattr(x, "value"))


def _model(sizes: Sizes, **overrides):
    from transformer_zoo import models

    cfg = models.get_preset(sizes.preset, vocab_size=sizes.vocab, **overrides)
    return models.EncoderDecoder(cfg)


# ---------------------------------------------------------------- train step


def _train_batch(sizes: Sizes) -> dict:
    rng = np.random.default_rng(1)
    shape = (sizes.batch, sizes.src_len)
    ones = np.ones(shape, np.int32)
    pos = np.broadcast_to(np.arange(sizes.src_len, dtype=np.int32), shape)
    batch = {"inputs": rng.integers(4, sizes.vocab, shape, dtype=np.int32),
             "targets": rng.integers(4, sizes.vocab, shape, dtype=np.int32),
             "inputs_segmentation": ones, "targets_segmentation": ones,
             "inputs_position": pos, "targets_position": pos}
    return jax.device_put(batch)


def train_flops(cfg, non_embedding: int, batch: int, source: int, target: int) -> float:
    """benchmarks/train_step.py's MFU numerator (forward + backward = 3x forward)."""
    dense = 6 * non_embedding * batch * target
    # QK^T and AV, 2 FLOPs per multiply-add: encoder self, decoder self and cross.
    pairs = (cfg.num_encoder_layers * source * source
             + cfg.num_decoder_layers * (target * target + target * source))
    width = cfg.num_heads * cfg.resolved_head_dim
    return dense + 3 * 2 * 2 * batch * width * pairs


def _non_embedding(cfg, params) -> int:
    """Parameters outside the embedding tables, plus the tied output projection."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    embed = sum(x.size for path, x in leaves if getattr(path[-1], "key", None) == "embedding")
    total = sum(x.size for _, x in leaves)
    return total - embed + (cfg.d_model * cfg.vocab_size if cfg.tie_output else 0)


def bench_train(sizes: Sizes, steps: int) -> dict:
    from transformer_zoo.configs import common
    from transformer_zoo.train.state import create_train_state, make_optimizer
    from transformer_zoo.train.step import make_train_step

    model = _model(sizes, dtype="bfloat16")
    cfg = model.config
    tx, schedule = make_optimizer(common.base_config().optim, cfg.d_model, 100_000)
    batch = _train_batch(sizes)
    params = _unboxed_params(model, batch["inputs"], batch["targets"])
    non_embedding = _non_embedding(cfg, params)
    state = create_train_state(params, tx, 0)
    step_fn = jax.jit(make_train_step(model, "encoder_decoder", SMOOTHING, schedule),
                      donate_argnums=0)
    compiled, compile_s = _compile(step_fn, state, batch)
    losses = []
    for _ in range(WARMUP_STEPS):
        state, metrics = compiled(state, batch)
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):  # back to back: the host runs ahead of the device
        state, metrics = compiled(state, batch)
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - start) / steps
    return {"cfg": cfg, "ms": 1e3 * seconds, "compile_s": compile_s, "steps": steps,
            "tokens_per_s": sizes.batch * sizes.src_len / seconds,
            "flops": train_flops(cfg, non_embedding, sizes.batch, sizes.src_len, sizes.src_len),
            "non_embedding": non_embedding, "losses": (float(losses[0]), float(losses[-1]))}


def print_train(row: dict, sizes: Sizes, peak: float | None) -> None:
    cfg = row["cfg"]
    print(f"\n## train step: preset {sizes.preset!r} (D {cfg.d_model}, {cfg.num_encoder_layers}"
          f"+{cfg.num_decoder_layers} layers, V {cfg.vocab_size}, {cfg.dtype} compute), "
          f"batch {sizes.batch} x {sizes.src_len} + {sizes.src_len} tokens")
    print(f"model FLOPs/step: {row['flops'] / 1e9:.1f} G ({row['non_embedding'] / 1e6:.2f}M "
          "non-embedding params incl. output); peak "
          + (f"{peak / 1e12:.1f} TFLOP/s" if peak else "unknown"))
    mfu = f"{100 * row['flops'] / (row['ms'] / 1e3) / peak:.1f}%" if peak else "n/a"
    print("| ms/step | target tok/s | MFU | compile s | steps | loss first -> last |")
    print("|" + " --- |" * 6)
    first, last = row["losses"]
    print(f"| {row['ms']:.2f} | {row['tokens_per_s']:.0f} | {mfu} | {row['compile_s']:.1f} "
          f"| {row['steps']} | {first:.3f} -> {last:.3f} |")


# ---------------------------------------------------------------- attention


def _attention_grad(impl: str):
    """Jitted (q, k, v, ct) -> ((dq, dk, dv), out) of sum(attention(q, k, v) * ct)."""
    from transformer_zoo import models

    def loss(q, k, v, ct):
        T, S = q.shape[1], k.shape[1]
        mask = models.AttentionMask(q_positions=jnp.arange(T)[None],
                                    kv_positions=jnp.arange(S)[None], causal=True)
        out = models.dot_product_attention(q, k, v, mask=mask, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


def _attention_inputs(sizes: Sizes, length: int):
    B, N, H = sizes.attn_shape
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, ct = (jax.random.normal(key, (B, length, N, H), jnp.float32) for key in keys)
    return (q, k, v), ct


def _max_error(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _attention_row(impl: str, qkv, ct, reference, repeats: int) -> dict:
    """Errors against the float32 reference and fwd+bwd time of one impl (bf16)."""
    args = (*(x.astype(jnp.bfloat16) for x in qkv), ct)
    try:
        compiled, compile_s = _compile(_attention_grad(impl), *args)
        grads, out = compiled(*args)
        times = _times(compiled, *args, repeats=repeats)
    except Exception as exc:  # a kernel that cannot run here: its reason is the result
        return {"impl": impl, "reason": _reason(exc)}
    ref_grads, ref_out = reference
    return {"impl": impl, "fwd_err": _max_error(out, ref_out),
            "grad_err": _max_error(grads, ref_grads), "ms": 1e3 * statistics.median(times),
            "compile_s": compile_s}


def bench_attention(sizes: Sizes, repeats: int) -> list[dict]:
    rows = []
    for length in sizes.attn_lengths:
        qkv, ct = _attention_inputs(sizes, length)
        with jax.default_matmul_precision("highest"):  # no TF32 in the float32 reference
            reference = jax.block_until_ready(_attention_grad("xla")(*qkv, ct))
        scale = tuple(max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(part))
                      for part in (reference[1], reference[0]))
        for impl in ATTENTION_IMPLS:
            rows.append({"T": length, "scale": scale,
                         **_attention_row(impl, qkv, ct, reference, repeats)})
        del reference
    return rows


def print_attention(rows: list[dict], sizes: Sizes) -> None:
    B, N, H = sizes.attn_shape
    print(f"\n## attention: B {B}, N {N}, H {H}, T = S, causal, bfloat16; errors against "
          "xla in float32; fwd+bwd median time")
    print("| T | impl | fwd max err | grad max err | fwd+bwd ms | speedup vs xla | compile s |")
    print("|" + " --- |" * 7)
    for r in rows:
        xla = next(x for x in rows if x["T"] == r["T"] and x["impl"] == "xla")
        if "reason" in r:
            print(f"| {r['T']} | {r['impl']} | {r['reason']} | | | | |")
            continue
        speedup = f"{xla['ms'] / r['ms']:.2f}x" if "ms" in xla else "-"
        print(f"| {r['T']} | {r['impl']} | {r['fwd_err']:.2e} | {r['grad_err']:.2e} "
              f"| {r['ms']:.3f} | {speedup} | {r['compile_s']:.1f} |")
    for length in sizes.attn_lengths:
        out_max, grad_max = next(r["scale"] for r in rows if r["T"] == length)
        print(f"T {length}: reference max |out| {out_max:.3g}, max |grad| {grad_max:.3g}")


# ---------------------------------------------------------------- decoding


def _decoder(model, search: str, use_cache: bool, max_extra: int):
    from transformer_zoo.models import generate as gen

    kw = dict(max_extra=max_extra, eos_id=-1, use_cache=use_cache)
    if search == "greedy":
        return jax.jit(functools.partial(gen.translate_greedy, model, **kw))
    return jax.jit(functools.partial(gen.translate, model, beam_size=4, alpha=0.6, **kw))


def _decode_run(model, params, inputs, search: str, use_cache: bool, max_extra: int):
    """(row, tokens) of one search: best-of-3 ms/step after compilation."""
    compiled, compile_s = _compile(_decoder(model, search, use_cache, max_extra),
                                   params, inputs)
    tokens = np.asarray(compiled(params, inputs))
    steps = inputs.shape[1] + max_extra  # eos_id=-1: every row runs the whole buffer
    seconds = min(_times(compiled, params, inputs, repeats=DECODE_REPEATS))
    tag = "cached" if use_cache else "no cache"
    return {"search": f"{search}, {tag}", "ms": 1e3 * seconds / steps,
            "compile_s": compile_s}, tokens


def bench_decode(sizes: Sizes, dtype: str) -> dict:
    model = _model(sizes, dtype=dtype, dropout_rate=0.0)
    shape = (sizes.decode_batch, sizes.decode_src)
    inputs = jax.random.randint(jax.random.key(1), shape, 3, model.config.vocab_size)
    params = _unboxed_params(model, inputs, inputs)
    runs = [_decode_run(model, params, inputs, s, c, sizes.max_extra)
            for s, c in (("greedy", True), ("greedy", False), ("beam-4", True))]
    (cached, cached_tokens), (recomputed, recomputed_tokens), (beam, _) = runs
    equal_rows = int(np.sum(np.all(cached_tokens == recomputed_tokens, axis=1)))
    return {"rows": [cached, recomputed, beam], "speedup": recomputed["ms"] / cached["ms"],
            "equal_rows": equal_rows, "batch": shape[0], "cfg": model.config}


def print_decode(result: dict, sizes: Sizes) -> None:
    cfg = result["cfg"]
    steps = sizes.decode_src + sizes.max_extra
    print(f"\n## decode: EncoderDecoder {sizes.preset!r} (D {cfg.d_model}, V {cfg.vocab_size}, "
          f"{cfg.dtype}), random weights, batch {sizes.decode_batch}, source "
          f"{sizes.decode_src}, {steps} steps (eos_id -1)")
    print("| search | ms/step | compile s |")
    print("|" + " --- |" * 3)
    for r in result["rows"]:
        print(f"| {r['search']} | {r['ms']:.3f} | {r['compile_s']:.1f} |")
    print(f"greedy cached vs use_cache=False: {result['speedup']:.1f}x faster; tokens equal in "
          f"{result['equal_rows']}/{result['batch']} rows")


# ---------------------------------------------------------------- dropout


def _dropout_fns(rate: float) -> dict:
    """name -> (x, key) -> y: the counter-hash masks and the threefry reference."""
    from transformer_zoo import models

    def threefry(x, key):
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))

    return {"threefry": threefry, "hash": lambda x, key: models.dropout(x, rate, key)}


def _fwd_bwd(fn):
    """x, key -> (y, dL/dx) with L = sum(y) in float32 (the backward reapplies the mask)."""
    def loss(x, key):
        y = fn(x, key)
        return jnp.sum(y.astype(jnp.float32)), y

    def both(x, key):
        grad, y = jax.grad(loss, has_aux=True)(x, key)
        return y, grad

    return both


def bench_dropout(sizes: Sizes, repeats: int) -> list[dict]:
    x = jax.random.normal(jax.random.key(4), sizes.dropout_shape, jnp.bfloat16)
    key = jax.random.key(5, impl="threefry2x32")
    rows = []
    for name, fn in _dropout_fns(0.1).items():
        for mode, f in (("forward", fn), ("forward + backward", _fwd_bwd(fn))):
            compiled, compile_s = _compile(jax.jit(f), x, key)
            times = _times(compiled, x, key, repeats=repeats)
            rows.append({"masks": name, "mode": mode, "ms": 1e3 * statistics.median(times),
                         "compile_s": compile_s})
    return rows


def print_dropout(rows: list[dict], sizes: Sizes) -> None:
    print(f"\n## dropout 0.1 on {list(sizes.dropout_shape)} bfloat16, median time")
    print("| masks | mode | ms | threefry / this | compile s |")
    print("|" + " --- |" * 5)
    ref = {r["mode"]: r["ms"] for r in rows if r["masks"] == "threefry"}
    for r in rows:
        print(f"| {r['masks']} | {r['mode']} | {r['ms']:.3f} | {ref[r['mode']] / r['ms']:.2f}x "
              f"| {r['compile_s']:.1f} |")
    hash_ms = next(r["ms"] for r in rows if r["masks"] == "hash" and r["mode"] != "forward")
    verdict = "yes" if hash_ms < ref["forward + backward"] else "no"
    print(f"hash masks faster than threefry (forward + backward) here: {verdict}")


# ---------------------------------------------------------------- main


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed train steps, attention and dropout calls (default 20; "
                             "2 with --smoke)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak for MFU, overriding the device_kind table")
    parser.add_argument("--decode-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of the decode section")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on any device: a dry run of the script itself")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown or not args.sections:
        parser.error(f"--sections: unknown {unknown} or empty; choose from {','.join(SECTIONS)}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def _device_or_exit(smoke: bool):
    """The first device; without --smoke, exit 1 with one line unless it is a GPU."""
    try:
        devices = jax.devices()
    except Exception as exc:  # e.g. JAX_PLATFORMS names a backend that is not installed
        devices, error = [], _reason(exc)
    else:
        error = None
    if not smoke and (error or devices[0].platform != "gpu"):
        print(f"accelerator.py: no GPU visible (jax.devices() -> {error or devices}); run it on "
              "a GPU machine, or pass --smoke for a tiny CPU dry run", file=sys.stderr)
        sys.exit(1)
    if error:
        print(f"accelerator.py: no device: {error}", file=sys.stderr)
        sys.exit(1)
    return devices[0]


def _run_section(name: str, sizes: Sizes, args, peak: float | None) -> None:
    steps = args.steps or sizes.steps
    if name == "train":
        print_train(bench_train(sizes, steps), sizes, peak)
    elif name == "attention":
        print_attention(bench_attention(sizes, steps), sizes)
    elif name == "decode":
        print_decode(bench_decode(sizes, args.decode_dtype), sizes)
    else:
        print_dropout(bench_dropout(sizes, steps), sizes)


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = _device_or_exit(args.smoke)
    sizes = SMOKE if args.smoke else FULL
    peak = peak_flops(device.device_kind, args.peak_tflops)
    print(f"jax {jax.__version__}, {jax.device_count()} x {device.device_kind} "
          f"({device.platform}){', smoke sizes' if args.smoke else ''}")
    failed = []
    for name in (s for s in SECTIONS if s in args.sections):
        start = time.perf_counter()
        try:
            _run_section(name, sizes, args, peak)
        except Exception:  # report it and keep the other sections' numbers
            failed.append(name)
            print(f"\n## {name}: FAILED (traceback on stderr)")
            traceback.print_exc()
        print(f"({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    if failed:
        print(f"accelerator.py: sections failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

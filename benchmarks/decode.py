"""Decoding speed: KV cache against recomputing the whole prefix every step.

    python benchmarks/decode.py [--encoder-decoder-only] [--kernels portable]

EncoderDecoder at the Multi30k recipe size (D 256, 4 heads, F 1024, 3 + 3
layers, V 8192), batch 8, source length 32, 64 new tokens, greedy and beam 4;
then a decoder-only model of the same width (3 layers) generating 64 to 512
tokens. EOS is disabled (eos_id=-1), so every run decodes its full length.
The no-cache reference (`use_cache=False`) reruns the full teacher-forced
decoder over the prefix padded to the maximum length at every step; its steps
all cost the same, so for the decoder-only model it is timed over its first
16 steps of a run sized for N tokens. ms/token is wall time per decoding step
(one token for each of the 8 rows), best of a few runs after compilation.
The models run with the XLA:CPU layer (kernels=cpu: streamed weight products in
the cached steps), as `python -m transformer_zoo.train.decode` does on CPU; `--kernels
portable` times the portable default instead.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from transformer_zoo import models
from transformer_zoo.models import decoding
from transformer_zoo.models import generate as gen

BATCH, SOURCE_LEN, NEW_TOKENS, PROMPT_LEN, NO_CACHE_STEPS = 8, 32, 64, 16, 16
SIZES = dict(d_model=256, num_heads=4, d_ff=1024, vocab_size=8192, dropout_rate=0.0)


def _timed(compiled, *args, repeats: int) -> float:
    """Best wall time (s) of `repeats` runs of an already compiled function."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _compile(jitted, *args, **static):
    """(compiled, seconds to trace + compile)."""
    start = time.perf_counter()
    compiled = jitted.lower(*args, **static).compile()
    return compiled, time.perf_counter() - start


def _init(model, *example):
    return jax.jit(model.init)(jax.random.PRNGKey(0), *example)["params"]


def bench_encoder_decoder(kernels: str) -> list[dict]:
    cfg = models.ModelConfig(**SIZES, num_encoder_layers=3, num_decoder_layers=3,
                             kernels=kernels)
    model = models.EncoderDecoder(cfg)
    inputs = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SOURCE_LEN), 3, cfg.vocab_size)
    params = _init(model, inputs, inputs)
    extra = NEW_TOKENS - SOURCE_LEN  # the buffer holds S + max_extra = 64 tokens
    searches = {"greedy": (gen.translate_greedy, {}),
                "beam-4": (gen.translate_beams, {"beam_size": 4, "alpha": 0.6})}
    rows = []
    for name, (fn, kw) in searches.items():
        row, outputs = {"search": name}, {}
        for use_cache in (True, False):
            compiled, compile_s = _compile(fn, model, params, inputs, max_extra=extra, eos_id=-1,
                                           use_cache=use_cache, **kw)
            outputs[use_cache] = compiled(params, inputs)
            seconds = _timed(compiled, params, inputs, repeats=3 if use_cache else 1)
            tag = "cache" if use_cache else "no_cache"
            row[f"{tag}_ms"], row[f"{tag}_compile_s"] = 1e3 * seconds / NEW_TOKENS, compile_s
        # The reference must decode the same tokens, or the comparison means nothing.
        np.testing.assert_array_equal(*jax.tree_util.tree_leaves(outputs[True])[:1],
                                      *jax.tree_util.tree_leaves(outputs[False])[:1])
        rows.append(row)
    return rows


def _lm_runner(model, n_tokens: int, steps: int, use_cache: bool):
    """Jitted greedy run of `steps` steps on a state sized for `n_tokens`."""

    def run(params, prompts):
        step, state, first = gen.prepare_generation(model, params, prompts, n_tokens,
                                                    use_cache=use_cache)
        return decoding.greedy_search(step, state, first, steps, eos_id=-1)

    return jax.jit(run)


def bench_decoder_only(kernels: str) -> list[dict]:
    cfg = models.ModelConfig(**SIZES, num_decoder_layers=3, kernels=kernels)
    model = models.DecoderOnly(cfg)
    prompts = jax.random.randint(jax.random.PRNGKey(2), (BATCH, PROMPT_LEN), 3, cfg.vocab_size)
    params = _init(model, prompts)
    rows = []
    for n in (64, 128, 256, 512):
        row = {"tokens": n}
        for use_cache, steps in ((True, n), (False, NO_CACHE_STEPS)):
            compiled, compile_s = _compile(_lm_runner(model, n, steps, use_cache), params, prompts)
            seconds = _timed(compiled, params, prompts, repeats=3 if use_cache else 1)
            tag = "cache" if use_cache else "no_cache"
            row[f"{tag}_ms"], row[f"{tag}_compile_s"] = 1e3 * seconds / steps, compile_s
        rows.append(row)
    return rows


def _print_encoder_decoder(rows):
    print(f"EncoderDecoder (D 256, 3+3 layers, V 8192), batch {BATCH}, source {SOURCE_LEN}, "
          f"{NEW_TOKENS} new tokens")
    print("| search | cache ms/token | no-cache ms/token | speedup | compile cache s "
          "| compile no-cache s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['search']} | {r['cache_ms']:.2f} | {r['no_cache_ms']:.2f} "
              f"| {r['no_cache_ms'] / r['cache_ms']:.1f}x | {r['cache_compile_s']:.1f} "
              f"| {r['no_cache_compile_s']:.1f} |")


def _print_decoder_only(rows):
    print(f"\nDecoderOnly (D 256, 3 layers, V 8192), greedy, batch {BATCH}, prompt {PROMPT_LEN}")
    print("| new tokens | cache ms/token | vs 64 | no-cache ms/token | vs 64 | speedup "
          "| compile cache s |")
    print("|---|---|---|---|---|---|---|")
    base = rows[0]
    for r in rows:
        print(f"| {r['tokens']} | {r['cache_ms']:.2f} | {r['cache_ms'] / base['cache_ms']:.2f}x "
              f"| {r['no_cache_ms']:.2f} | {r['no_cache_ms'] / base['no_cache_ms']:.2f}x "
              f"| {r['no_cache_ms'] / r['cache_ms']:.1f}x | {r['cache_compile_s']:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder-decoder-only", action="store_true",
                        help="skip the decoder-only length sweep (~2 min instead of ~5)")
    parser.add_argument("--kernels", choices=[k.value for k in models.Kernels], default="cpu",
                        help="the models' kernels (default cpu, as the decode CLI)")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} "
          f"device(s), kernels={args.kernels}")
    enc = bench_encoder_decoder(args.kernels)
    _print_encoder_decoder(enc)
    fast_enough = all(r["no_cache_ms"] / r["cache_ms"] >= 5 for r in enc)
    print(f"\ncache >= 5x faster at {NEW_TOKENS} tokens: {fast_enough}")
    greedy, beam = (next(r["cache_ms"] for r in enc if r["search"] == s)
                    for s in ("greedy", "beam-4"))
    print(f"per step: greedy {greedy:.2f} ms (target <= 2.5), beam-4 {beam:.2f} ms "
          "(target <= 8)")
    if args.encoder_decoder_only:
        return
    lm = bench_decoder_only(args.kernels)
    _print_decoder_only(lm)
    flat = lm[-1]["cache_ms"] / lm[0]["cache_ms"] <= 1.5
    print(f"cached cost flat (512 vs 64 within 1.5x): {flat}")


if __name__ == "__main__":
    main()

"""Input pipeline throughput on Multi30k en-de: tokens/s of finished batches.

    python benchmarks/input_pipeline.py [--data_dir ../shared/data/multi30k] [--bpe_dropout 0.1]

Trains a joint sentencepiece vocabulary (~8000, in a temp dir, not timed), then
times tokenise + length filter + pack/bucket + batch, single process, and prints
a table. Then, in the same run, times the training step of the Multi30k recipe
(configs/multi30k.py: model, optimizer and its packed 64 x 64 batches) and
prints the ratio of tokens the pipeline produces to tokens training consumes
per second (the target: >= 5x, so input is never the bottleneck). With
--bpe_dropout, the packed recipe is timed again with that rate of BPE-dropout
(data/bpe_dropout.py: segmentation sampled in Python), in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from transformer_zoo.train.host_memory import restart_with_huge_pages  # noqa: E402

restart_with_huge_pages()  # as python -m transformer_zoo.train does (train/host_memory.py)

from transformer_zoo import data  # noqa: E402

DEFAULT_DIR = os.path.join(_ROOT, "..", "shared", "data", "multi30k")


def pipeline_tokens_per_second(
    examples,
    tokenizer: data.Tokenizer,
    batching: data.Batching,
    *,
    num_batches: int = 200,
    warmup_batches: int = 5,
    bpe_dropout: float = 0.0,
) -> tuple[float, float]:
    """Times ``num_batches`` training batches of ``make_batches``.

    Returns:
      (non-padding tokens per second, fraction of batch slots that are tokens),
      counting inputs and targets tokens.
    """
    it = iter(data.make_batches(examples, batching, tokenizer=tokenizer, train=True, seed=0,
                                shard_index=0, shard_count=1, bpe_dropout=bpe_dropout))
    for _ in range(warmup_batches):
        next(it)
    tokens = slots = 0
    start = time.perf_counter()
    for _ in range(num_batches):
        batch = next(it)
        for key in ("inputs", "targets"):
            tokens += int((batch[key + "_segmentation"] > 0).sum())
            slots += batch[key].size
    elapsed = time.perf_counter() - start
    return tokens / elapsed, tokens / slots


def training_tokens_per_second(examples, tokenizer, *, num_steps: int = 10) -> float:
    """Non-padding tokens per second a Multi30k-recipe train step consumes (after compile)."""
    import jax

    from transformer_zoo.configs import multi30k
    from transformer_zoo.train.loop import init_params
    from transformer_zoo.train.state import create_train_state, make_optimizer
    from transformer_zoo.train.step import make_train_step
    from transformer_zoo.train.tasks import build_model, model_config_from

    config = multi30k.get_config()
    model = build_model(config.family, model_config_from(config.model, tokenizer.vocab_size))
    tx, schedule = make_optimizer(config.optim, config.model.d_model, config.train.num_steps)
    state = create_train_state(init_params(model, config.family, 0), tx, 0)
    step = jax.jit(make_train_step(model, config.family, 0.1, schedule), donate_argnums=0)
    d = config.data
    batching = data.Batching(mode=d.batching, batch_size=d.batch_size,
                             max_inputs_length=d.max_inputs_length,
                             max_targets_length=d.max_targets_length)
    it = iter(data.make_batches(examples, batching, tokenizer=tokenizer, train=True, seed=0,
                                shard_index=0, shard_count=1))
    batches = [next(it) for _ in range(num_steps + 2)]
    for batch in batches[:2]:  # compile and warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    tokens = sum(int((b[k + "_segmentation"] > 0).sum()) for b in batches[2:]
                 for k in ("inputs", "targets"))
    start = time.perf_counter()
    for batch in batches[2:]:
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return tokens / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=DEFAULT_DIR)
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--num_batches", type=int, default=200)
    parser.add_argument("--bpe_dropout", type=float, default=0.0,
                        help="also time the recipe's batches with this BPE-dropout rate")
    args = parser.parse_args(argv)
    src, tgt = (os.path.join(args.data_dir, f"train.{lang}") for lang in ("en", "de"))
    if not (os.path.exists(src) and os.path.exists(tgt)):
        print(f"SKIP: Multi30k not found at {os.path.abspath(args.data_dir)} "
              "(see ../shared/data/README.md)")
        return 0
    examples = data.parallel_files(src, tgt)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        tokenizer = data.train_sentencepiece(data.sample_texts(examples), tmp,
                                             vocab_size=args.vocab_size)
        train_s = time.perf_counter() - start
    print(f"Multi30k en-de: {len(examples)} pairs; sentencepiece bpe vocab "
          f"{tokenizer.vocab_size} trained in {train_s:.1f} s\n")
    common = {"max_inputs_length": 64, "max_targets_length": 64}
    configs = {
        "pack 64x64, 4096 tok/batch": data.Batching(mode="pack", tokens_per_batch=4096, **common),
        "bucket, 4096 tok/batch": data.Batching(mode="bucket", tokens_per_batch=4096, **common),
        "bucket, 64 ex/batch": data.Batching(mode="bucket", batch_size=64, **common),
    }
    print(f"| {'batching':28} | {'tokens/s':>10} | {'non-pad':>7} |")
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 9}|")
    for name, batching in configs.items():
        rate, density = pipeline_tokens_per_second(examples, tokenizer, batching,
                                                   num_batches=args.num_batches)
        print(f"| {name:28} | {rate:10,.0f} | {density:7.1%} |")
    recipe = data.Batching(mode="pack", batch_size=64, **common)  # configs/multi30k.py
    produced, _ = pipeline_tokens_per_second(examples, tokenizer, recipe,
                                             num_batches=args.num_batches)
    consumed = training_tokens_per_second(examples, tokenizer)
    print(f"\nMulti30k recipe (pack, 64 rows x 64): pipeline {produced:,.0f} tokens/s, "
          f"train step {consumed:,.0f} tokens/s -> pipeline/training = "
          f"{produced / consumed:.1f}x (target >= 5x)")
    if args.bpe_dropout:
        sampled, _ = pipeline_tokens_per_second(examples, tokenizer, recipe,
                                                num_batches=args.num_batches,
                                                bpe_dropout=args.bpe_dropout)
        print(f"with BPE-dropout {args.bpe_dropout}: pipeline {sampled:,.0f} tokens/s -> "
              f"pipeline/training = {sampled / consumed:.1f}x; {sampled / produced:.2f}x the "
              f"pipeline without it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

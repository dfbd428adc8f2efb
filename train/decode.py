"""python -m transformer_zoo.train.decode: restore a run's parameters, decode, score.

    python -m transformer_zoo.train.decode --workdir DIR [--step N] --input FILE|- [--output FILE]
        [--beam_size 4 --alpha 0.6 | --temperature T --top_k K --top_p P]
        [--reference FILE]

Encoder-decoder runs translate each input line (beam search; --beam_size 1 is
greedy); decoder-only runs continue each line as a prompt (greedy unless
--temperature > 0). With --reference, prints exact match, sacreBLEU and chrF.
Errors (no checkpoint, unknown step, input too long) exit with code 1 and
write nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import jax

from transformer_zoo.train.parallel import kernels_for
from transformer_zoo.train.predict import load_run, score


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m transformer_zoo.train.decode",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="run directory with checkpoints/")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--input", required=True, help="one sentence or prompt per line; - = stdin")
    p.add_argument("--output", default=None, help="output file (default: stdout)")
    p.add_argument("--reference", default=None, help="references, one per line")
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--max_extra", type=int, default=50, help="max output = input length + this")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=100, help="decoder-only")
    p.add_argument("--temperature", type=float, default=0.0, help="decoder-only; 0 = greedy")
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return [line.rstrip("\n") for line in sys.stdin]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file {p} does not exist")
    return p.read_text(encoding="utf-8").splitlines()


def run(args) -> list[str]:
    lines = _read_lines(args.input)
    references = _read_lines(args.reference) if args.reference else None
    if references is not None and len(references) != len(lines):
        raise ValueError(f"--reference has {len(references)} lines, --input has {len(lines)}")
    # The XLA:CPU layer where jax computes on CPUs (the same values, faster there).
    loaded = load_run(args.workdir, args.step, kernels=kernels_for(jax.devices()))
    if loaded.family == "encoder_decoder":
        outputs = loaded.translate(lines, beam_size=args.beam_size, alpha=args.alpha,
                                   max_extra=args.max_extra, batch_size=args.batch_size)
    else:
        outputs = loaded.generate(lines, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
    text = "".join(o + "\n" for o in outputs)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    if references is not None:
        scores = score(outputs, references)
        print(f"step {loaded.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in scores.items())
              + f"  ({len(lines)} lines)", file=sys.stderr)
    return outputs


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's read-only notices
    args = _parser().parse_args(argv)
    try:
        run(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m transformer_zoo.train.convert: Hugging Face checkpoints in and out.

    python -m transformer_zoo.train.convert from-hf SRC_DIR WORKDIR
    python -m transformer_zoo.train.convert to-hf WORKDIR DST_DIR [--step N]

from-hf reads a Hugging Face folder (config.json; model.safetensors, its
sharded index, or pytorch_model.bin, which needs torch; the tokenizer files if
any) of a BERT, GPT-2 or Marian model and writes a new WORKDIR that
`load_run`, `python -m transformer_zoo.train.decode` and `init_from` read.
to-hf writes a workdir's checkpoint (default: the latest) as a new folder of
config.json, model.safetensors and the tokenizer files, which `transformers`
loads with `from_pretrained`. Errors (unsupported architecture or setting,
missing or damaged file, a shape that does not match its config, an output
that already exists) exit with code 1, print one line and write nothing.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence

import jax

from transformer_zoo.train import hf
from transformer_zoo.train.cli import one_line

PROG = "python -m transformer_zoo.train.convert"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 1, as every command here
        raise ValueError(f"{message} (see {PROG} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    source = commands.add_parser("from-hf", help="a Hugging Face folder -> a new workdir")
    source.add_argument("src_dir")
    source.add_argument("workdir")
    target = commands.add_parser("to-hf", help="a workdir -> a new Hugging Face folder")
    target.add_argument("workdir")
    target.add_argument("dst_dir")
    target.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    return parser


def _describe(converted: hf.Converted) -> str:
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(converted.params))
    tokenizer = converted.tokenizer
    kind = (f"{type(tokenizer).__name__}, {tokenizer.vocab_size} ids" if tokenizer is not None
            else "none")
    return (f"{converted.model_type} ({converted.family}, {count / 1e6:.1f}M parameters; "
            f"tokenizer: {kind})")


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `argv` without the program name (default sys.argv[1:]); returns the code."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.command == "from-hf":
            converted = hf.from_hf(args.src_dir, args.workdir)
            print(f"wrote {args.workdir}: {_describe(converted)} from {args.src_dir}")
        else:
            converted = hf.to_hf(args.workdir, args.dst_dir, step=args.step)
            print(f"wrote {args.dst_dir}: {_describe(converted)} from {args.workdir}")
    except (OSError, ValueError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

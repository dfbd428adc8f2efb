"""python -m transformer_zoo.train.average: average the parameters of a run's last checkpoints.

    python -m transformer_zoo.train.average --workdir DIR --last 5 --output DIR_AVG

The paper averaged the last 5 (base) or 20 (big) checkpoints. The output is a
params-only run directory (config + tokenizer + one checkpoint) that
`python -m transformer_zoo.train.decode --workdir DIR_AVG` decodes from.
Flags are absl flags, as for `python -m transformer_zoo.train`. Errors (bad
flags, no checkpoints, fewer than --last of them, an output that already holds
checkpoints) exit with code 1, print one line on stderr and write nothing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from transformer_zoo.train.checkpoint import average_checkpoints
from transformer_zoo.train.cli import one_line, parse_flags
from transformer_zoo.train.input import copy_tokenizer
from transformer_zoo.train.predict import load_run

PROG = "python -m transformer_zoo.train.average"


def average_run(workdir, output, last_n: int) -> int:
    """Averages the last `last_n` checkpoints of `workdir` into `output`; returns the step."""
    if isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < 1:
        raise ValueError(f"last_n (--last) must be a positive int, got {last_n!r}")
    template = load_run(workdir)  # the model's parameter structure and shapes
    step = average_checkpoints(workdir, output, last_n, template.params)
    copy_tokenizer(workdir, output)
    return step


def define_flags(fv: flags.FlagValues) -> None:
    """Declares the average flags on `fv`."""
    kw = {"flag_values": fv}
    flags.DEFINE_string("workdir", None, "Run directory whose checkpoints are averaged.", **kw)
    flags.DEFINE_integer("last", None, "How many of the latest checkpoints to average.",
                         lower_bound=1, **kw)
    flags.DEFINE_string("output", None, "New run directory for the average.", **kw)
    flags.mark_flags_as_required(["workdir", "last", "output"], flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `argv` without the program name (default sys.argv[1:]); returns the code."""
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        fv = parse_flags(PROG, __doc__, define_flags, sys.argv[1:] if argv is None else argv)
        if fv is None:
            return 0
        step = average_run(Path(fv.workdir), Path(fv.output), fv.last)
    except (flags.Error, OSError, ValueError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    print(f"averaged the last {fv.last} checkpoints of {fv.workdir} into {fv.output} "
          f"(step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

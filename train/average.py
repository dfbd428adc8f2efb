"""python -m transformer_zoo.train.average: average the parameters of a run's last checkpoints.

    python -m transformer_zoo.train.average --workdir DIR --last 5 --output DIR_AVG

The paper averaged the last 5 (base) or 20 (big) checkpoints. The output is a
params-only run directory (config + tokenizer + one checkpoint) that
`python -m transformer_zoo.train.decode --workdir DIR_AVG` decodes from.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from transformer_zoo.train.checkpoint import average_checkpoints
from transformer_zoo.train.input import tokenizer_dir
from transformer_zoo.train.predict import load_run


def average_run(workdir, output, last_n: int) -> int:
    """Averages the last `last_n` checkpoints of `workdir` into `output`; returns the step."""
    template = load_run(workdir)  # the model's parameter structure and shapes
    step = average_checkpoints(workdir, output, last_n, template.params)
    shutil.copytree(tokenizer_dir(workdir), tokenizer_dir(output), dirs_exist_ok=True)
    return step


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("absl").setLevel(logging.ERROR)
    p = argparse.ArgumentParser(prog="python -m transformer_zoo.train.average",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--last", type=int, required=True, help="number of latest checkpoints")
    p.add_argument("--output", required=True, help="new run directory for the average")
    args = p.parse_args(argv)
    try:
        step = average_run(Path(args.workdir), Path(args.output), args.last)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"averaged the last {args.last} checkpoints of {args.workdir} into {args.output} "
          f"(step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m transformer_zoo.train --config configs/<recipe>.py --workdir DIR [--config.x=...]

Trains (resuming from DIR if it holds checkpoints), evaluates, decodes
held-out examples and prints the metric.
"""

from transformer_zoo.train.host_memory import restart_with_huge_pages

# Before numpy or jax are imported: on CPU, restarts this command once with
# glibc's huge-page tunable, so XLA's per-step buffers are not faulted in 4 KiB
# at a time (train/host_memory.py).
restart_with_huge_pages()

import logging  # noqa: E402
import sys  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer_zoo.train.cli import one_line  # noqa: E402
from transformer_zoo.train.loop import NonFiniteLossError, train_and_evaluate  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, tokenizer, metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def _parse_flags(argv):
    """absl's flag parsing; a misspelt or badly typed --config.* override is one line."""
    try:
        return FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as err:
        print(f"error: bad flags: {one_line(err)}", file=sys.stderr)
        sys.exit(1)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    for noisy in ("absl", "jax", "orbax", "tensorstore", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except (NonFiniteLossError, ValueError, FileNotFoundError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

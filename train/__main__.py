"""python -m train --config configs/<recipe>.py --workdir DIR [--config.field=value ...]

Trains (resuming from DIR if it holds checkpoints), evaluates, decodes
held-out examples and prints the metric.
"""

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from train.loop import NonFiniteLossError, train_and_evaluate

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, tokenizer, metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    for noisy in ("absl", "jax", "orbax", "tensorstore", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)

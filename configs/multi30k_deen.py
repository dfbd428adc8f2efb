"""Multi30k German -> English: configs/multi30k.py with the two sides swapped.

    python -m transformer_zoo.train --config configs/multi30k_deen.py --workdir runs/multi30k_deen

The check that the English -> German recipe generalises: the same model, joint
vocabulary, schedule, checkpoint choice and search, every one chosen on en->de val, with
no further tuning; only the source and target files change places. It scores
test2016 44.04 BLEU / 63.29 chrF (val 44.31 / 64.34, the final checkpoint, on an AMD
EPYC Zen 3; README, results).
"""

import ml_collections

from transformer_zoo.configs import multi30k


def get_config() -> ml_collections.ConfigDict:
    config = multi30k.get_config()
    d = config.data
    for split in ("train", "eval", "test"):
        source, target = d[f"{split}_source"], d[f"{split}_target"]
        d[f"{split}_source"], d[f"{split}_target"] = target, source
    return config

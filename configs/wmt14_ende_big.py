"""The paper's big model on WMT14 English -> German (Table 3, "big").

    python -m transformer_zoo.train --config configs/wmt14_ende_big.py --workdir runs/wmt14_big

Same data preparation as configs/wmt14_ende_base.py.
"""

import ml_collections

from transformer_zoo.configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
    config = wmt14_ende_base.get_config()
    config.model.update(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
    config.train.num_steps = 300_000  # 3.5 days on 8 P100s in the paper
    config.train.keep_checkpoints = 20
    config.train.average_last = 20  # the paper averaged the last 20
    return config

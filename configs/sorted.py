"""Encoder-only sequence classification: is a letter sequence sorted? (embedded, no download)

    python -m transformer_zoo.train --config configs/sorted.py --workdir runs/sorted
"""

import ml_collections

from transformer_zoo.configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config(task="sorted")  # data.sorted_classification: label 1 iff sorted
    config.family = "encoder_only"
    config.model.update(d_model=64, num_heads=4, d_ff=128, num_encoder_layers=2,
                        num_decoder_layers=0, dropout_rate=0.0, num_classes=2,
                        norm_position="pre", position_encoding="learned", max_length=32)

    d = config.data
    d.num_symbols = 10
    d.num_train_examples = 100_000
    d.num_eval_examples = 1000
    d.batching = "bucket"  # classification batches hold one example per row
    d.batch_size = 64
    d.max_inputs_length = 24

    o = config.optim
    o.update(schedule="warmup_cosine", learning_rate=1e-3, end_learning_rate=1e-5,
             warmup_steps=100)

    t = config.train
    t.num_steps = 1000
    t.eval_every = 500
    t.checkpoint_every = 500
    t.label_smoothing = 0.0
    return config

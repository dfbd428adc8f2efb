"""A character-level decoder-only LM on tiny shakespeare (the usual CPU-sized recipe).

    python -m transformer_zoo.train --config configs/tinyshakespeare.py --workdir runs/shakespeare

4 layers, 4 heads, width 128, context 64, batch 12, 2000 steps, dropout 0,
AdamW (beta2 0.99), lr 1e-3 with 100 warmup steps and cosine decay to 1e-4.
First 90% of the text for training, last 10% for validation; prints a 300-character
sample at the end.
"""

import ml_collections

from transformer_zoo.configs import common
from transformer_zoo.configs.paths import SHARED_DATA


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config(task="text_file")
    config.family = "decoder_only"
    config.model.update(d_model=128, num_heads=4, d_ff=512, num_encoder_layers=0,
                        num_decoder_layers=4, dropout_rate=0.0, norm_position="pre",
                        position_encoding="learned", ffn_activation="gelu", max_length=64,
                        tie_output=True)

    d = config.data
    d.path = str(SHARED_DATA / "tinyshakespeare" / "input.txt")
    d.train_fraction = 0.9  # the usual split: first 90% train, last 10% validation
    d.seq_length = 64  # context
    d.batch_size = 12
    d.max_eval_batches = 200  # 200 x 12 x 64 = 154k validation characters

    o = config.optim
    o.update(name="adamw", b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1,
             schedule="warmup_cosine", learning_rate=1e-3, end_learning_rate=1e-4,
             warmup_steps=100, clip_norm=1.0)

    t = config.train
    t.num_steps = 2000
    t.log_every = 100
    t.eval_every = 500
    t.checkpoint_every = 1000
    t.label_smoothing = 0.0  # report plain nats per character

    # At the end: 300 sampled characters (temperature 0.8), printed and in WORKDIR/sample.txt.
    config.decode.update(sample_length=300, sample_prompt="ROMEO:", sample_temperature=0.8)
    return config

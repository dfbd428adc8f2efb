"""A decoder-only language model on tfds lm1b (One Billion Word).

    tfds build lm1b --file_format=array_record    # once, with '.[prepare]'
    python -m transformer_zoo.train --config configs/lm1b.py --workdir runs/lm1b
"""

import ml_collections

from transformer_zoo.configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config(task="tfds_text")
    config.family = "decoder_only"
    config.model.update(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=0,
                        num_decoder_layers=6, dropout_rate=0.1, norm_position="pre",
                        position_encoding="rope", ffn_activation="gelu", max_length=256)

    d = config.data
    d.tfds_name = "lm1b"
    d.text_key = "text"
    d.train_split = "train"
    d.eval_split = "test"
    d.max_eval_examples = 10_000
    d.vocab_size = 32000
    d.spm_model_type = "unigram"
    d.spm_max_sentences = 1_000_000
    d.batching = "pack"  # several sentences per 128-token row
    d.batch_size = 128
    d.seq_length = 128

    o = config.optim
    o.update(name="adamw", b2=0.98, weight_decay=0.1, schedule="warmup_cosine",
             learning_rate=6e-4, end_learning_rate=6e-5, warmup_steps=2000, clip_norm=1.0)

    t = config.train
    t.num_steps = 100_000
    t.eval_every = 5000
    t.checkpoint_every = 5000
    t.label_smoothing = 0.0  # perplexity is the metric
    return config

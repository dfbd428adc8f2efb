"""A long-context character LM on tiny shakespeare: 2048 characters of context, RoPE, blockwise.

    python -m transformer_zoo.train --config configs/shakespeare_long.py --workdir runs/long

The char LM of configs/tinyshakespeare.py (4 layers, width 128, d_ff 512, pre-norm,
GELU, tied output) with a 2048-character context instead of 64: RoPE instead of a
learned table (so nothing ties the model to one length), 2 heads of 64 (the
blockwise tiles' matmuls run faster at head dim 64 than 32) and blockwise attention,
which never forms the [2048, 2048] score matrix. Trained by sequence length: first
6000 steps of 12 rows of 64 characters (WORKDIR/pre_stage), then 300 steps of one
2048-character row from those params (WORKDIR). At the end the held-out text is
scored in 4096-character rows too (`long_context_loss` in
WORKDIR/final_metrics.json): twice the trained context, the RoPE extrapolation the
positional-encoding notes discuss. README "Results" has the numbers.
"""

import ml_collections

from transformer_zoo.configs import tinyshakespeare


def get_config() -> ml_collections.ConfigDict:
    config = tinyshakespeare.get_config()
    config.model.update(num_heads=2, position_encoding="rope", attention_impl="blockwise",
                        max_length=4096)

    d = config.data
    d.seq_length = 2048  # context
    d.batch_size = 1  # one 2048-character row per step
    d.max_eval_batches = None  # all of the held-out text (54 rows)
    d.long_eval_length = 4096  # at the end: the held-out text in rows of twice the context

    # A sequence-length curriculum (Press et al. 2021, Shortformer): the pre-stage
    # trains the same model on 12 rows of 64 characters from anywhere in the text,
    # ~5x the optimizer steps per second of 2048-character rows; the run then
    # continues from it at context 2048 for a few hundred steps, the only steps
    # that cost the long row's price (RoPE carries no position table to outgrow).
    config.pre_stage = ml_collections.ConfigDict(dict(
        data=dict(seq_length=64, batch_size=12, long_eval_length=None),
        optim=dict(learning_rate=1e-3, end_learning_rate=1e-4, warmup_steps=100),
        train=dict(num_steps=6000, eval_every=1500, checkpoint_every=3000),
        decode=dict(sample_length=0),
    ))
    config.optim.update(learning_rate=1e-3, end_learning_rate=1e-4, warmup_steps=20)

    t = config.train
    t.num_steps = 300
    t.eval_every = 100
    t.checkpoint_every = 100
    return config

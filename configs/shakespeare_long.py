"""A long-context character LM on tiny shakespeare: 2048 characters of context, RoPE, blockwise.

    python -m transformer_zoo.train --config configs/shakespeare_long.py --workdir runs/long

The char LM of configs/tinyshakespeare.py (4 layers, width 128, d_ff 512, pre-norm,
GELU, tied output) with a 2048-character context instead of 64: RoPE instead of a
learned table (so nothing ties the model to one length), 2 heads of 64 (the
blockwise tiles' matmuls run faster at head dim 64 than 32) and blockwise attention,
which never forms the [2048, 2048] score matrix. One 2048-character row per step;
lr 3e-3 (the row is one contiguous window, so steps are few and large). At the end
the held-out text is scored in 4096-character rows too (`long_context_loss` in
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

    config.optim.update(learning_rate=3e-3, end_learning_rate=3e-4, warmup_steps=100)

    t = config.train
    t.num_steps = 2000
    t.eval_every = 500
    t.checkpoint_every = 500
    return config

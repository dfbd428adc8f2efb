"""A seconds-long recipe for tests: the default task with a tiny model.

Usable as a config file (`--config tests/train/tiny_config.py`) and from Python.
"""

from transformer_zoo.configs import default


def get_config():
    config = default.get_config()
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                        num_decoder_layers=1, position_encoding="learned", max_length=32)
    d = config.data
    d.num_train_examples = 4000
    d.num_eval_examples = 64
    d.batch_size = 8
    d.max_inputs_length = 8
    d.max_targets_length = 16
    d.eval_batch_size = 32
    d.num_decode_examples = 16
    config.optim.update(schedule="constant", learning_rate=5e-3)
    t = config.train
    t.num_steps = 30
    t.log_every = 1
    t.eval_every = 0
    t.checkpoint_every = 10
    config.decode.beam_size = 2
    config.decode.num_print = 0
    return config

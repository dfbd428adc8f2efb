"""The paper's base model on WMT14 English -> German (Vaswani et al. 2017, Table 3).

    pip install -e '.[prepare]'   # TensorFlow, only to build the dataset once
    tfds build wmt14_translate/de-en --file_format=array_record
    python -m transformer_zoo.train --config configs/wmt14_ende_base.py --workdir runs/wmt14_base

Training reads the prepared ArrayRecord files without TensorFlow.
"""

import ml_collections

from transformer_zoo.configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config(task="tfds_translation")
    config.family = "encoder_decoder"
    # Base: N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1, eps_ls=0.1 (the defaults).
    config.model.update(max_length=256)

    d = config.data
    d.tfds_name = "wmt14_translate/de-en"
    d.source_key = "en"
    d.target_key = "de"
    d.train_split = "train"
    d.eval_split = "validation"  # newstest2013: selection only
    d.test_split = "test"  # newstest2014, decoded once at the end (the paper's Table 2)
    d.max_eval_examples = 3000
    d.tfds_data_dir = None  # default tfds data dir (~/tensorflow_datasets)
    d.vocab_size = 37000  # the paper's shared source-target BPE vocabulary
    d.spm_model_type = "bpe"
    d.spm_character_coverage = 1.0
    d.spm_byte_fallback = False
    d.spm_max_sentences = 2_000_000  # bounded sample of the 4.5M pairs
    d.batching = "pack"
    d.tokens_per_batch = 25_000  # the paper: ~25k source + ~25k target tokens
    d.batch_size = None
    d.max_inputs_length = 256
    d.max_targets_length = 256
    d.eval_batch_size = 64
    d.num_decode_examples = 3000  # BLEU on newstest2013 at the end

    o = config.optim
    o.schedule = "rsqrt_warmup"  # lr = d_model^-0.5 * min(step^-0.5, step * 4000^-1.5)
    o.learning_rate = 1.0
    o.warmup_steps = 4000

    t = config.train
    t.num_steps = 100_000  # 12 hours on 8 P100s in the paper
    t.log_every = 100
    t.eval_every = 5000
    t.checkpoint_every = 2000  # the paper: every 10 minutes
    t.keep_checkpoints = 5
    t.average_last = 5  # the paper: the last 5 checkpoints, written every 10 minutes

    config.decode.update(beam_size=4, alpha=0.6, max_extra=50, metric="bleu")
    return config

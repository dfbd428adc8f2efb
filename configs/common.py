"""Fields every recipe shares, with their defaults (one comment per field; the model,
data, decode and train sections are declared in configs/schema.py)."""

import ml_collections

from transformer_zoo.configs import schema


def base_config(task: str = "numbers") -> ml_collections.ConfigDict:
    """The fields every recipe shares, at their defaults, with the `data` section of `task`.

    The `model`, `data`, `decode` and `train` sections are declared in
    configs/schema.py (model: every models.ModelConfig field, with its default) and
    locked: a misspelt field is an error, in a recipe and on the command line.
    """
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameters, dropout (fold_in(step)) and data shuffling
    config.family = "encoder_decoder"  # encoder_decoder | decoder_only | encoder_only
    config.init_from = ""  # another run's workdir: start from its latest params (fine-tuning)
    # Overrides by section (data=dict(seq_length=64), ...) trained first, in
    # WORKDIR/pre_stage; the run then starts from its params (train/stages.py).
    config.pre_stage = ml_collections.ConfigDict()
    config.model = schema.section(schema.MODEL_FIELDS)  # vocab_size: the tokenizer's
    config.data = schema.data_section(task)  # the fields of schema.DATA_TASKS[task]

    config.optim = ml_collections.ConfigDict(dict(
        name="adam",  # adam | adamw (weight decay masked off norms and biases)
        b1=0.9,
        b2=0.98,  # the paper's beta2
        eps=1e-9,  # the paper's epsilon
        weight_decay=0.0,  # adamw only
        schedule="rsqrt_warmup",  # rsqrt_warmup | warmup_cosine | inverse_sqrt | constant
        learning_rate=1.0,  # peak lr; for rsqrt_warmup a multiplier of the formula
        end_learning_rate=0.0,  # final lr of warmup_cosine
        warmup_steps=4000,  # the paper's warmup
        clip_norm=0.0,  # global-norm clipping; 0 = off
        grad_accum_steps=1,  # optax.MultiSteps micro-batches per update
    ))

    config.train = schema.section(schema.TRAIN_FIELDS)

    # Devices (train/parallel.py). Defaults: data parallel over all devices (one
    # device: no parallelism). Presets are mesh shapes: fsdp (1, -1, 1), tp (1, 1, -1).
    config.parallel = ml_collections.ConfigDict(dict(
        mesh_shape=(-1, 1, 1),  # sizes of mesh axes (data, fsdp, tensor); -1 = the rest
        logical_axis_rules=[  # (logical axis, mesh axis | list of axes | None), first match wins
            ("batch", ["data", "fsdp"]),
            ("embed", "fsdp"),  # FSDP / ZeRO-3: params and Adam moments split on d_model
            ("heads", "tensor"),  # Megatron tensor parallelism: heads, FFN hidden, vocab
            ("kv_heads", "tensor"),
            ("mlp", "tensor"),
            ("vocab", "tensor"),
            ("length", None),
            ("kv", None),
            ("classes", None),
        ],
        step="jit",  # jit (any mesh) | shard_map | pmap (both data parallel only)
        distributed=False,  # call jax.distributed.initialize (implied by a coordinator)
        coordinator_address="",  # host:port of process 0; "" = $JAX_COORDINATOR_ADDRESS
        num_processes=0,  # 0 = $JAX_NUM_PROCESSES or cluster auto-detection
        process_id=-1,  # -1 = $JAX_PROCESS_ID or cluster auto-detection
    ))

    config.decode = schema.section(schema.DECODE_FIELDS)
    return config

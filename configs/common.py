"""Fields every recipe shares, with their defaults (one comment per field)."""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameters, dropout (fold_in(step)) and data shuffling
    config.family = "encoder_decoder"  # encoder_decoder | decoder_only | encoder_only
    config.init_from = ""  # another run's workdir: start from its latest params (fine-tuning)

    # models.ModelConfig fields (vocab_size comes from the tokenizer).
    config.model = ml_collections.ConfigDict(dict(
        d_model=512,  # D
        num_heads=8,  # N
        num_kv_heads=None,  # K (GQA); None = N
        d_ff=2048,  # F
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout_rate=0.1,  # residual + embedding dropout (the paper's P_drop)
        attention_dropout_rate=0.0,  # dropout on attention weights
        ffn_activation="relu",  # relu | gelu | swiglu | geglu
        norm="layernorm",  # layernorm | rmsnorm
        norm_position="post",  # post (paper) | pre
        position_encoding="sinusoidal",  # sinusoidal | learned | rope | alibi | none
        max_length=256,  # learned position table size
        share_embeddings=True,  # encoder/decoder embeddings shared (joint vocabulary)
        tie_output=True,  # pre-softmax projection = decoder embedding
        attention_impl="xla",  # see models.attention_impls()
        num_classes=None,  # encoder_only: classes of the pooled head
        dtype="float32",  # compute dtype; "bfloat16" for mixed precision
        param_dtype="float32",  # parameter (and optimizer state) dtype
    ))
    config.model.lock()

    config.data = ml_collections.ConfigDict()  # filled by each recipe (see train/input.py)

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

    config.train = ml_collections.ConfigDict(dict(
        num_steps=100_000,  # optimizer steps (micro-steps with accumulation)
        label_smoothing=0.1,  # the paper's epsilon_ls
        log_every=100,
        eval_every=1000,  # 0 = only at the end
        checkpoint_every=1000,
        keep_checkpoints=5,  # the latest K are kept (the paper averaged 5 / 20)
        best_metric="loss",  # eval metric whose best checkpoint is kept too ("" = off)
        best_mode="min",
        # At the end: average the params of the last N checkpoints (into WORKDIR/averaged),
        # decode the held-out set with both, keep the better (selection on held-out data
        # only) and decode data.test_source with it if a recipe sets one. 0/1 = off.
        average_last=0,
    ))

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

    config.decode = ml_collections.ConfigDict(dict(
        beam_size=4,  # the paper's beam
        alpha=0.6,  # GNMT length penalty ((5 + |Y|) / 6)^alpha
        max_extra=50,  # max output length = input length + 50
        batch_size=64,  # sentences per decoding batch
        num_print=5,  # decoded examples printed at the end
        eval_examples=100,  # held-out examples decoded at each periodic eval; 0 = at the end only
        metric="bleu",  # bleu (sacreBLEU + chrF) | exact_match
    ))
    return config

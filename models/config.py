"""ModelConfig: one frozen, keyword-only description of every model family.

The three families (EncoderDecoder, DecoderOnly, EncoderOnly) read the fields
they need. Variant fields take a member of their `models.variants` enum or its
string and hold the member after construction (`position_encoding`, `norm`,
`norm_position`, `ffn_activation`, `score_fn`, `pooling`, `attention_impl`,
`kernels`). The fields after `num_classes` that default to off (token types,
the embedding norm, the pooler, the MLM transform, the output bias) exist for
published checkpoints (BERT, GPT-2, Marian; train/hf/).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from transformer_zoo.models.variants import (
    AttentionImpl,
    FfnActivation,
    Kernels,
    Norm,
    NormPosition,
    Pooling,
    PositionEncoding,
    ScoreFn,
    parse,
    parse_attention_impl,
)

# The enum of each variant field (attention_impl is checked against its registry).
VARIANT_FIELDS = {
    "ffn_activation": FfnActivation,
    "norm": Norm,
    "norm_position": NormPosition,
    "position_encoding": PositionEncoding,
    "score_fn": ScoreFn,
    "pooling": Pooling,
    "kernels": Kernels,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of a Transformer (defaults: the paper's base model).

    Attributes:
      vocab_size: V of the targets (decoder input and output; the LM vocabulary).
      input_vocab_size: V of the encoder inputs; None = same as vocab_size.
      d_model: D, the residual stream width.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (GQA; 1 = multi-query); None = N.
      head_dim: d_k per head; None = D / N.
      v_head_dim: d_v per head; None = head_dim.
      d_ff: F, the FFN hidden width.
      num_encoder_layers: encoder blocks (EncoderDecoder, EncoderOnly).
      num_decoder_layers: decoder blocks (EncoderDecoder, DecoderOnly).
      dropout_rate: residual dropout on each sublayer output and on
        embeddings + positions (the paper's P_drop).
      attention_dropout_rate: dropout on attention weights.
      activation_dropout_rate: dropout on the FFN hidden activations.
      ffn_activation: relu (paper), gelu (tanh approximation), gelu_exact
        (erf), silu, swiglu or geglu.
      norm: layernorm or rmsnorm.
      norm_epsilon: epsilon of the norms.
      norm_position: post (paper: LayerNorm(x + Dropout(Sublayer(x)))) or pre
        (x + Dropout(Sublayer(LayerNorm(x))), with a final norm).
      position_encoding: sinusoidal, sinusoidal_concat (sines, then cosines:
        Marian), learned, rope, alibi or none.
      max_length: rows of the learned position table (and the longest input
        any family accepts with learned positions).
      rope_base: RoPE's base frequency.
      use_bias: biases in the attention and FFN projections (the paper: yes).
      score_fn: dot (scaled dot product) or additive (Bahdanau).
      attention_impl: registered dot_product_attention implementation.
      attention_window: sliding window w of every self-attention (a query sees
        the w latest positions when causal, |offset| <= w // 2 otherwise), in
        training and while decoding; attention_impl="local" needs it.
      share_embeddings: encoder and decoder share one embedding table (needs
        input_vocab_size == vocab_size).
      tie_output: the pre-softmax projection reuses the decoder embedding.
      scale_embeddings: multiply embeddings by sqrt(D).
      num_classes: classes of EncoderOnly's pooled head (None = no head).
      type_vocab_size: rows of a token-type (segment A/B) embedding added to
        the token embeddings (BERT: 2); 0 = none.
      embedding_norm: a norm on embeddings + positions, before dropout (BERT).
      pooling: which vector EncoderOnly's pooler reads: mean (of the first
        segment) or first (BERT's [CLS]).
      pooler: EncoderOnly's tanh pooler (dense D -> D) even without num_classes;
        its output is returned as "pooled" (BERT's pooler_output).
      mlm_transform: EncoderOnly's token head first applies dense D -> D, the
        FFN activation and a norm (BERT's masked-LM prediction head).
      output_bias: a learned bias over the vocabulary added to the logits
        (Marian's final_logits_bias, BERT's MLM bias).
      output_ids: the only ids the decoder's output scores, ascending (e.g. the
        target side's pieces of a joint vocabulary, data/output_vocab.py); the
        logits of every other id are OUTPUT_MASK_VALUE, so their probability
        is 0, and the training loss is a softmax over these alone (train/step.py).
        None = all of vocab_size.
      pad_id: padding id (masks are built from it).
      bos_id: the id the decoder input starts with (shift right; Marian and
        T5 start with their pad id).
      eos_id: end of sequence (decoding stops there).
      dtype: compute dtype (activations); softmax and logits stay float32.
      param_dtype: parameter dtype.
      kernels: PORTABLE (plain JAX, every platform and transform) or CPU (the
        XLA:CPU layer of models/cpu_kernels.py: the same values, faster on CPU,
        reverse-mode only). The CLIs choose CPU when the mesh's devices are CPUs.
    """

    vocab_size: int = 37000
    input_vocab_size: int | None = None
    d_model: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    activation_dropout_rate: float = 0.0
    ffn_activation: FfnActivation = FfnActivation.RELU
    norm: Norm = Norm.LAYERNORM
    norm_epsilon: float = 1e-6
    norm_position: NormPosition = NormPosition.POST
    position_encoding: PositionEncoding = PositionEncoding.SINUSOIDAL
    max_length: int = 512
    rope_base: float = 10000.0
    use_bias: bool = True
    score_fn: ScoreFn = ScoreFn.DOT
    attention_impl: AttentionImpl | str = AttentionImpl.XLA
    attention_window: int | None = None
    share_embeddings: bool = True
    tie_output: bool = True
    scale_embeddings: bool = True
    num_classes: int | None = None
    type_vocab_size: int = 0
    embedding_norm: bool = False
    pooling: Pooling = Pooling.MEAN
    pooler: bool = False
    mlm_transform: bool = False
    output_bias: bool = False
    output_ids: tuple[int, ...] | None = None
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 1
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernels: Kernels = Kernels.PORTABLE

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
        for name, kind in VARIANT_FIELDS.items():
            object.__setattr__(self, name, parse(kind, getattr(self, name), f"ModelConfig.{name}"))
        object.__setattr__(self, "attention_impl", parse_attention_impl(
            self.attention_impl, "ModelConfig.attention_impl"))
        if self.output_ids is not None:  # a saved config holds a JSON list; hashable here
            object.__setattr__(self, "output_ids", tuple(int(i) for i in self.output_ids))
        _validate(self)

    @property
    def resolved_input_vocab_size(self) -> int:
        return self.vocab_size if self.input_vocab_size is None else self.input_vocab_size

    @property
    def output_size(self) -> int:
        """Classes of the decoder's softmax: len(output_ids), else vocab_size."""
        return self.vocab_size if self.output_ids is None else len(self.output_ids)

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _validate(cfg: ModelConfig) -> None:
    for field in ("vocab_size", "d_model", "num_heads", "d_ff", "max_length"):
        if getattr(cfg, field) <= 0:
            raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(cfg, field)}")
    for field in ("num_kv_heads", "head_dim", "v_head_dim", "input_vocab_size", "num_classes"):
        if getattr(cfg, field) is not None and getattr(cfg, field) <= 0:
            raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(cfg, field)}")
    if cfg.head_dim is None and cfg.d_model % cfg.num_heads:
        raise ValueError(
            f"d_model={cfg.d_model} is not divisible by num_heads={cfg.num_heads}; "
            "change one or set head_dim"
        )
    if cfg.num_heads % cfg.resolved_num_kv_heads:
        raise ValueError(
            f"num_heads={cfg.num_heads} is not divisible by num_kv_heads={cfg.num_kv_heads}"
        )
    if cfg.position_encoding == "rope" and cfg.resolved_head_dim % 2:
        raise ValueError(
            f"position_encoding='rope' needs an even head_dim, got {cfg.resolved_head_dim}"
        )
    for field in ("dropout_rate", "attention_dropout_rate", "activation_dropout_rate"):
        if not 0.0 <= getattr(cfg, field) < 1.0:
            raise ValueError(f"ModelConfig.{field} must be in [0, 1), got {getattr(cfg, field)}")
    if cfg.type_vocab_size < 0:
        raise ValueError(f"ModelConfig.type_vocab_size must be >= 0, got {cfg.type_vocab_size}")
    for field in ("pad_id", "bos_id", "eos_id"):
        if getattr(cfg, field) < 0:
            raise ValueError(f"ModelConfig.{field} must be a token id >= 0, got "
                             f"{getattr(cfg, field)}")
    if cfg.attention_window is not None and cfg.attention_window < 1:
        raise ValueError(f"ModelConfig.attention_window must be >= 1, got {cfg.attention_window}")
    if cfg.attention_impl == AttentionImpl.LOCAL and cfg.attention_window is None:
        raise ValueError("ModelConfig.attention_impl='local' needs attention_window")
    _validate_output_ids(cfg)
    if cfg.share_embeddings and cfg.resolved_input_vocab_size != cfg.vocab_size:
        raise ValueError(
            f"share_embeddings=True needs input_vocab_size ({cfg.input_vocab_size}) == "
            f"vocab_size ({cfg.vocab_size})"
        )


def _validate_output_ids(cfg: ModelConfig) -> None:
    ids = cfg.output_ids
    if ids is None:
        return
    if not ids or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError("ModelConfig.output_ids must be non-empty, ascending and distinct, got "
                         f"{len(ids)} ids starting {list(ids[:5])}")
    if ids[0] < 0 or ids[-1] >= cfg.vocab_size:
        raise ValueError(f"ModelConfig.output_ids must lie in [0, vocab_size={cfg.vocab_size}), "
                         f"got {ids[0]}..{ids[-1]}")
    if cfg.eos_id not in ids:
        raise ValueError(f"ModelConfig.output_ids must hold eos_id={cfg.eos_id}, or decoding "
                         "could never end")


PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. 2017, Table 3: base and big (shared 37000 BPE vocabulary).
    "base": dict(d_model=512, d_ff=2048, num_heads=8, num_encoder_layers=6,
                 num_decoder_layers=6, dropout_rate=0.1, vocab_size=37000),
    "big": dict(d_model=1024, d_ff=4096, num_heads=16, num_encoder_layers=6,
                num_decoder_layers=6, dropout_rate=0.3, vocab_size=37000),
    # Small sizes for tests and CPU recipes.
    "tiny": dict(d_model=64, d_ff=128, num_heads=4, num_encoder_layers=2,
                 num_decoder_layers=2, dropout_rate=0.1, vocab_size=128, max_length=128),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named preset with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; choose from {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})

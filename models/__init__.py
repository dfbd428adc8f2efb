"""Pure-functional Flax (linen) Transformer modules.

Shape letters used in every docstring and einsum:
  B batch, T query length, S key/value length, N heads, K key/value heads,
  G = N / K groups, H head dim, D model dim, F ffn dim, V vocab.
Attention tensors are [B, T, N, H]; scores are [B, N, T, S].

Every module is plain, backend-neutral JAX by default (`kernels=Kernels.PORTABLE`):
grad, jvp, vmap and jax.export work through it on every platform. The XLA:CPU
layer (models/cpu_kernels.py) is opt-in with `kernels=Kernels.CPU`.
"""

# Importing the implementation modules registers them with dot_product_attention.
from transformer_zoo.models import (  # noqa: F401
    axes,
    blockwise,
    cpu_kernels,
    hardware_attention,
    linear_attention,
    local_attention,
    variants,
)
from transformer_zoo.models.attention import MultiHeadAttention
from transformer_zoo.models.blocks import DecoderBlock, EncoderBlock
from transformer_zoo.models.capture import capture_attention
from transformer_zoo.models.config import PRESETS, ModelConfig, get_preset
from transformer_zoo.models.dot_product import (
    alibi_bias,
    attention_impls,
    dot_product_attention,
    register_attention_impl,
)
from transformer_zoo.models.dropout import Dropout, dropout, keep_mask, keep_probability
from transformer_zoo.models.embedding import Embed
from transformer_zoo.models.masks import (
    AttentionMask,
    causal_mask,
    combine_masks,
    make_attention_mask,
    padding_mask,
    segment_mask,
)
from transformer_zoo.models.mlp import FeedForward
from transformer_zoo.models.nnx_bridge import (
    decode_step,
    has_cache,
    init_cache,
    linen_variables,
    to_nnx,
)
from transformer_zoo.models.norms import LayerNorm, RMSNorm
from transformer_zoo.models.positional import (
    LearnedPositionalEmbedding,
    alibi_slopes,
    apply_rope,
    sinusoidal_encoding,
)
from transformer_zoo.models.projection import Projection
from transformer_zoo.models.transformer import (
    OUTPUT_MASK_VALUE,
    DecoderOnly,
    EncoderDecoder,
    EncoderOnly,
    restrict_logits,
    shift_right,
)
from transformer_zoo.models.variants import (
    AttentionImpl,
    FfnActivation,
    Kernels,
    Norm,
    NormPosition,
    Pooling,
    PositionEncoding,
    ScoreFn,
)

__all__ = [
    "OUTPUT_MASK_VALUE",
    "PRESETS",
    "AttentionImpl",
    "AttentionMask",
    "DecoderBlock",
    "DecoderOnly",
    "Dropout",
    "Embed",
    "EncoderBlock",
    "EncoderDecoder",
    "EncoderOnly",
    "FeedForward",
    "FfnActivation",
    "Kernels",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "ModelConfig",
    "MultiHeadAttention",
    "Norm",
    "NormPosition",
    "Pooling",
    "PositionEncoding",
    "Projection",
    "RMSNorm",
    "ScoreFn",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_impls",
    "axes",
    "capture_attention",
    "cpu_kernels",
    "causal_mask",
    "combine_masks",
    "decode_step",
    "dot_product_attention",
    "dropout",
    "get_preset",
    "has_cache",
    "init_cache",
    "keep_mask",
    "keep_probability",
    "linen_variables",
    "make_attention_mask",
    "padding_mask",
    "register_attention_impl",
    "segment_mask",
    "restrict_logits",
    "shift_right",
    "sinusoidal_encoding",
    "to_nnx",
    "variants",
]

"""The variant families, each one `enum.StrEnum` defined once.

Every field or attribute that picks a variant (ModelConfig and the standalone
modules alike) accepts the enum member or its exact string, and is checked by
`parse` where it enters: a wrong value, including a wrong case ("RoPE"), is a
ValueError naming the field, the value and the choices. Members compare equal
to their strings, so `cfg.norm == "rmsnorm"` holds for either spelling.

Attention implementations are open: `register_attention_impl` adds names
beside the built-in `AttentionImpl` members, so they are checked against the
registry (`parse_attention_impl`).
"""

from __future__ import annotations

import enum


class PositionEncoding(enum.StrEnum):
    """How token order enters: added to the embeddings, or inside attention."""

    SINUSOIDAL = "sinusoidal"  # the paper's fixed encoding, added to the embeddings
    # The same frequencies with all sines first, then all cosines (tensor2tensor,
    # Marian / OPUS-MT): one permutation of the dimensions away from SINUSOIDAL.
    SINUSOIDAL_CONCAT = "sinusoidal_concat"
    LEARNED = "learned"  # a learned table of max_length rows, added
    ROPE = "rope"  # rotates queries and keys (self-attention)
    ALIBI = "alibi"  # per-head linear distance bias on the scores (self-attention)
    NONE = "none"


class Norm(enum.StrEnum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class NormPosition(enum.StrEnum):
    POST = "post"  # the paper: Norm(x + Dropout(Sublayer(x)))
    PRE = "pre"  # x + Dropout(Sublayer(Norm(x))), with a final norm


class FfnActivation(enum.StrEnum):
    RELU = "relu"  # the paper
    GELU = "gelu"  # tanh approximation (GPT-2's "gelu_new")
    GELU_EXACT = "gelu_exact"  # x * Phi(x) with erf (BERT's "gelu")
    SILU = "silu"  # x * sigmoid(x), not gated (Marian's "swish")
    SWIGLU = "swiglu"  # gated (Shazeer 2020): silu(x W) * (x V)
    GEGLU = "geglu"  # gated: gelu(x W) * (x V)


class Pooling(enum.StrEnum):
    """Which vector of the encoder output EncoderOnly's pooler reads."""

    MEAN = "mean"  # the mean over the first segment's tokens
    FIRST = "first"  # the first token (BERT's [CLS])


class ScoreFn(enum.StrEnum):
    DOT = "dot"  # scaled dot product
    ADDITIVE = "additive"  # Bahdanau: v^T tanh(q + k)


class AttentionImpl(enum.StrEnum):
    """The built-in implementations of `dot_product_attention`."""

    XLA = "xla"  # the reference: materialised [B, N, T, S] scores
    BLOCKWISE = "blockwise"  # online softmax over key blocks, O(T) memory
    LOCAL = "local"  # sliding window (needs attention_window)
    LINEAR = "linear"  # kernelised linear attention (a different function)
    CUDNN = "cudnn"  # cuDNN fused attention (NVIDIA GPU)
    PALLAS = "pallas"  # Pallas flash attention (GPU, TPU)
    AUTO = "auto"  # the best of the above for the platform compiled for


class Kernels(enum.StrEnum):
    """Which computation a module's matmuls, gradients and decoding steps use.

    PORTABLE is plain JAX (grad, jvp, vmap and export work through it on every
    platform). CPU adds the XLA:CPU layer of models/cpu_kernels.py: same values,
    faster on CPU, reverse-mode only; on other platforms it lowers to the
    portable computation. The training and decoding CLIs choose CPU when the
    mesh's devices are CPUs.
    """

    PORTABLE = "portable"
    CPU = "cpu"


def parse(kind: type[enum.StrEnum], value, field: str) -> enum.StrEnum:
    """`value` (a member or its exact string) as a member of `kind`.

    Args:
      kind: the variant family.
      value: what the caller passed.
      field: its name in error messages, e.g. "ModelConfig.norm".

    Raises:
      ValueError: `value` is not one of `kind`'s values.
    """
    try:
        return kind(value)
    except ValueError:
        choices = [member.value for member in kind]
        raise ValueError(f"{field}={value!r} is unknown; choose from {choices}") from None


def parse_attention_impl(value, field: str) -> str:
    """A built-in `AttentionImpl` member, or another registered name, else ValueError."""
    from transformer_zoo.models.dot_product import attention_impls

    if isinstance(value, str) and value in attention_impls():
        return AttentionImpl(value) if value in AttentionImpl._value2member_map_ else value
    raise ValueError(f"{field}={value!r} is unknown; choose from {list(attention_impls())}")

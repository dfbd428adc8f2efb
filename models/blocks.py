"""Encoder and decoder blocks with post-norm (paper) or pre-norm residuals.

post: x = Norm(x + Dropout(Sublayer(x)))        (Vaswani et al. 2017)
pre:  x = x + Dropout(Sublayer(Norm(x)))         (needs a final norm)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from transformer_zoo.models import axes
from transformer_zoo.models.attention import MultiHeadAttention
from transformer_zoo.models.config import ModelConfig
from transformer_zoo.models.cpu_kernels import stored_gradient
from transformer_zoo.models.dropout import Dropout
from transformer_zoo.models.mlp import FeedForward
from transformer_zoo.models.norms import make_norm
from transformer_zoo.models.variants import Kernels, NormPosition, PositionEncoding

Array = Any


def make_attention(cfg: ModelConfig, name: str, self_attention: bool = True) -> MultiHeadAttention:
    """The MultiHeadAttention the config describes (positions only act in self-attention)."""
    return MultiHeadAttention(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        v_head_dim=cfg.v_head_dim,
        use_bias=cfg.use_bias,
        dropout_rate=cfg.attention_dropout_rate,
        score_fn=cfg.score_fn,
        position_encoding=cfg.position_encoding if self_attention else PositionEncoding.NONE,
        rope_base=cfg.rope_base,
        attention_impl=cfg.attention_impl,
        attention_window=cfg.attention_window if self_attention else None,
        kernels=cfg.kernels,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        name=name,
    )


def make_ffn(cfg: ModelConfig) -> FeedForward:
    return FeedForward(
        d_ff=cfg.d_ff,
        activation=cfg.ffn_activation,
        dropout_rate=cfg.activation_dropout_rate,
        use_bias=cfg.use_bias,
        kernels=cfg.kernels,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        name="ffn",
    )


class Residual(nn.Module):
    """Wraps one sublayer with dropout, the residual and the norm placement."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, sublayer: Callable[[Array], Array], *, deterministic: bool):
        cfg = self.config
        norm = make_norm(cfg.norm, cfg.norm_epsilon, cfg.dtype, cfg.param_dtype, name="norm")
        drop = Dropout(cfg.dropout_rate)
        if cfg.norm_position == NormPosition.PRE:
            if cfg.kernels == Kernels.CPU:
                x = stored_gradient(x)  # XLA:CPU would recompute the residual gradient chain
            return x + drop(sublayer(norm(x)), deterministic=deterministic)
        return norm(x + drop(sublayer(x), deterministic=deterministic))


def _constrain(x):
    return nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.EMBED))


class EncoderBlock(nn.Module):
    """Self-attention + FFN."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, mask, *, positions=None, deterministic: bool = True) -> Array:
        """x [B, S, D], mask over [B, 1, S, S] -> [B, S, D]."""
        cfg = self.config
        attn = make_attention(cfg, "self_attention")
        x = Residual(cfg, name="attention_residual")(
            x,
            lambda h: attn(h, mask=mask, q_positions=positions, deterministic=deterministic),
            deterministic=deterministic,
        )
        ffn = make_ffn(cfg)
        x = Residual(cfg, name="ffn_residual")(
            x, lambda h: ffn(h, deterministic=deterministic), deterministic=deterministic
        )
        return _constrain(x)


class DecoderBlock(nn.Module):
    """Masked self-attention (+ cross-attention when `encoded` is given) + FFN."""

    config: ModelConfig
    cross_attention: bool = True

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask,
        *,
        encoded: Array | None = None,
        cross_mask=None,
        positions=None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> Array:
        """x [B, T, D], encoded [B, S, D] -> [B, T, D]."""
        cfg = self.config
        attn = make_attention(cfg, "self_attention")
        x = Residual(cfg, name="attention_residual")(
            x,
            lambda h: attn(
                h, mask=mask, q_positions=positions, deterministic=deterministic, decode=decode
            ),
            deterministic=deterministic,
        )
        if self.cross_attention:
            cross = make_attention(cfg, "cross_attention", self_attention=False)
            x = Residual(cfg, name="cross_residual")(
                x,
                lambda h: cross(
                    h, encoded, mask=cross_mask, deterministic=deterministic, decode=decode
                ),
                deterministic=deterministic,
            )
        ffn = make_ffn(cfg)
        x = Residual(cfg, name="ffn_residual")(
            x, lambda h: ffn(h, deterministic=deterministic), deterministic=deterministic
        )
        return _constrain(x)

"""The three families: EncoderDecoder, DecoderOnly, EncoderOnly.

All read one ModelConfig. Inputs follow the data/ batch format: token ids
[B, L] with PAD = config.pad_id, optional segment ids (1, 2, ... per packed
sequence, 0 on padding) and per-segment positions. Masks are built once here
and passed down by name.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from transformer_zoo.models import axes
from transformer_zoo.models.blocks import DecoderBlock, EncoderBlock
from transformer_zoo.models.config import ModelConfig
from transformer_zoo.models.dropout import Dropout
from transformer_zoo.models.embedding import Embed
from transformer_zoo.models.masks import AttentionMask
from transformer_zoo.models.mlp import dense
from transformer_zoo.models.norms import make_norm
from transformer_zoo.models.positional import LearnedPositionalEmbedding, sinusoidal_encoding
from transformer_zoo.models.variants import NormPosition, PositionEncoding

Array = Any


def default_segmentation(ids: Array, pad_id: int) -> Array:
    """Segment ids for an unpacked batch: 1 on tokens, 0 on padding."""
    return (ids != pad_id).astype(jnp.int32)


def default_positions(ids: Array) -> Array:
    """0..L-1 for every row: [B, L]."""
    return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)


def shift_right(targets: Array, bos_id: int, positions: Array | None = None) -> Array:
    """Decoder input: BOS then targets[:-1]; with packing, BOS at each segment start."""
    shifted = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)), constant_values=bos_id)
    if positions is not None:
        shifted = jnp.where(positions == 0, bos_id, shifted)
    return shifted


class Embedder(nn.Module):
    """Token embedding x sqrt(D) + absolute positions, then dropout."""

    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, ids: Array, positions: Array, *, deterministic: bool) -> Array:
        cfg = self.config
        if cfg.position_encoding == PositionEncoding.LEARNED and ids.shape[1] > cfg.max_length:
            raise ValueError(f"sequence length {ids.shape[1]} > max_length={cfg.max_length}")
        x = self.embed(ids)
        if cfg.position_encoding == PositionEncoding.SINUSOIDAL:
            x = x + sinusoidal_encoding(positions, cfg.d_model).astype(cfg.dtype)
        elif cfg.position_encoding == PositionEncoding.LEARNED:
            table = LearnedPositionalEmbedding(cfg.max_length, cfg.d_model, cfg.param_dtype,
                                               name="pos_embedding")
            x = x + table(positions).astype(cfg.dtype)
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.EMBED))


def _final_norm(cfg: ModelConfig, x: Array) -> Array:
    if cfg.norm_position != NormPosition.PRE:
        return x
    return make_norm(cfg.norm, cfg.norm_epsilon, cfg.dtype, cfg.param_dtype, name="final_norm")(x)


def _make_embed(cfg: ModelConfig, vocab: int, name: str) -> Embed:
    return Embed(vocab, cfg.d_model, cfg.scale_embeddings, cfg.dtype, cfg.param_dtype,
                 kernels=cfg.kernels, name=name)


class Encoder(nn.Module):
    """Embedding + N bidirectional encoder blocks."""

    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, inputs, segmentation, positions, *, deterministic: bool = True):
        """inputs [B, S] -> encoded [B, S, D]."""
        cfg = self.config
        embedder = Embedder(cfg, self.embed, name="embedder")
        x = embedder(inputs, positions, deterministic=deterministic)
        mask = AttentionMask(q_positions=positions, kv_positions=positions,
                             q_segment_ids=segmentation, kv_segment_ids=segmentation,
                             window=cfg.attention_window)
        for i in range(cfg.num_encoder_layers):
            x = EncoderBlock(cfg, name=f"layer_{i}")(
                x, mask, positions=positions, deterministic=deterministic
            )
        return _final_norm(cfg, x)


class Decoder(nn.Module):
    """Embedding + N causal decoder blocks (+ cross-attention) + logits."""

    config: ModelConfig
    embed: Embed
    num_layers: int
    cross_attention: bool = True

    @nn.compact
    def __call__(self, tokens, segmentation, positions, *, encoded=None, cross_mask=None,
                 deterministic: bool = True, decode: bool = False):
        """tokens [B, T] (already shifted) -> logits [B, T, V] float32."""
        cfg = self.config
        if decode:
            positions = self._decode_positions(tokens, positions)
            mask = None if segmentation is None else _decode_key_mask(segmentation)
        else:
            mask = AttentionMask(q_positions=positions, kv_positions=positions,
                                 q_segment_ids=segmentation, kv_segment_ids=segmentation,
                                 causal=True, window=cfg.attention_window)
        embedder = Embedder(cfg, self.embed, name="embedder")
        x = embedder(tokens, positions, deterministic=deterministic)
        for i in range(self.num_layers):
            x = DecoderBlock(cfg, self.cross_attention, name=f"layer_{i}")(
                x, mask, encoded=encoded, cross_mask=cross_mask, positions=positions,
                deterministic=deterministic, decode=decode,
            )
        x = _final_norm(cfg, x)
        if cfg.tie_output:
            return self.embed.attend(x, decode=decode)
        head = dense(cfg.vocab_size, axes.EMBED, axes.VOCAB, use_bias=False, kernels=cfg.kernels,
                     dtype=jnp.float32, param_dtype=cfg.param_dtype, name="logits")
        return head(x.astype(jnp.float32))

    def _decode_positions(self, tokens, positions):
        """Absolute positions while decoding: given, or counted in the cache."""
        initialised = self.has_variable("cache", "position")
        counter = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
        T = tokens.shape[1]
        if positions is None:
            positions = jnp.broadcast_to(counter.value + jnp.arange(T, dtype=jnp.int32),
                                         tokens.shape)
        if initialised:
            counter.value = counter.value + T
        return positions


def _decode_key_mask(key_valid: Array) -> Array:
    """While decoding, `segmentation` is a [B, S_max] key validity over cache slots."""
    return (key_valid != 0)[:, None, None, :]


def _ids_defaults(cfg, ids, segmentation, positions):
    segmentation = default_segmentation(ids, cfg.pad_id) if segmentation is None else segmentation
    positions = default_positions(ids) if positions is None else positions
    return segmentation, positions


class EncoderDecoder(nn.Module):
    """The paper's translation model.

    `__call__` is the training forward pass (teacher forcing); `encode` and
    `decode` are used by decoding, which calls `decode` with decode=True.
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.target_embed = _make_embed(cfg, cfg.vocab_size, "target_embed")
        self.source_embed = (self.target_embed if cfg.share_embeddings
                             else _make_embed(cfg, cfg.resolved_input_vocab_size, "source_embed"))
        self.encoder = Encoder(cfg, self.source_embed)
        self.decoder = Decoder(cfg, self.target_embed, cfg.num_decoder_layers)

    def encode(self, inputs, inputs_segmentation=None, inputs_position=None, *,
               deterministic: bool = True):
        """inputs [B, S] -> encoded [B, S, D]."""
        seg, pos = _ids_defaults(self.config, inputs, inputs_segmentation, inputs_position)
        return self.encoder(inputs, seg, pos, deterministic=deterministic)

    def decode(self, encoded, inputs_segmentation, decoder_tokens, targets_segmentation=None,
               targets_position=None, *, deterministic: bool = True, decode: bool = False):
        """Decoder logits [B, T, V] for (already shifted) decoder tokens [B, T].

        With decode=True, `targets_segmentation` is an optional [B, S_max]
        validity of the cache slots and `targets_position` the absolute
        positions of the fed tokens (default: counted in the cache). The
        first decode=True call, which creates the cache, must already get the
        real `encoded`: cross-attention caches its keys/values from it.
        """
        cfg = self.config
        if decode:
            cross_mask = (inputs_segmentation != 0)[:, None, None, :]
            seg, pos = targets_segmentation, targets_position
        else:
            seg, pos = _ids_defaults(cfg, decoder_tokens, targets_segmentation, targets_position)
            cross_mask = AttentionMask(
                q_positions=pos, kv_positions=jnp.zeros_like(inputs_segmentation),
                q_segment_ids=seg, kv_segment_ids=inputs_segmentation,
            )
        return self.decoder(decoder_tokens, seg, pos, encoded=encoded, cross_mask=cross_mask,
                            deterministic=deterministic, decode=decode)

    def __call__(self, inputs, targets, inputs_segmentation=None, targets_segmentation=None,
                 inputs_position=None, targets_position=None, *, deterministic: bool = True):
        """Teacher-forced logits [B, T, V] float32 for inputs [B, S], targets [B, T]."""
        cfg = self.config
        in_seg, in_pos = _ids_defaults(cfg, inputs, inputs_segmentation, inputs_position)
        tgt_seg, tgt_pos = _ids_defaults(cfg, targets, targets_segmentation, targets_position)
        encoded = self.encode(inputs, in_seg, in_pos, deterministic=deterministic)
        decoder_tokens = shift_right(targets, cfg.bos_id, tgt_pos)
        return self.decode(encoded, in_seg, decoder_tokens, tgt_seg, tgt_pos,
                           deterministic=deterministic)


class DecoderOnly(nn.Module):
    """GPT-style causal language model."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = _make_embed(cfg, cfg.vocab_size, "embed")
        self.decoder = Decoder(cfg, self.embed, cfg.num_decoder_layers, cross_attention=False)

    def __call__(self, targets, targets_segmentation=None, targets_position=None, *,
                 deterministic: bool = True, decode: bool = False):
        """Logits [B, T, V] float32.

        Training (decode=False): predicts targets[t] from targets[<t] (the input
        is shifted right with BOS). Decoding (decode=True): `targets` are the
        tokens to feed as they are (prompt prefill or one new token);
        `targets_segmentation` is then an optional [B, S_max] slot validity.
        """
        cfg = self.config
        if decode:
            return self.decoder(targets, targets_segmentation, targets_position,
                                deterministic=deterministic, decode=True)
        seg, pos = _ids_defaults(cfg, targets, targets_segmentation, targets_position)
        tokens = shift_right(targets, cfg.bos_id, pos)
        return self.decoder(tokens, seg, pos, deterministic=deterministic)


class EncoderOnly(nn.Module):
    """Bidirectional encoder with a token-level head and a pooled classifier."""

    config: ModelConfig

    @nn.compact
    def __call__(self, inputs, inputs_segmentation=None, inputs_position=None, *,
                 deterministic: bool = True) -> dict[str, Array]:
        """Returns {"token_logits": [B, S, V]} and, with num_classes, {"class_logits": [B, C]}."""
        cfg = self.config
        embed = _make_embed(cfg, cfg.resolved_input_vocab_size, "embed")
        seg, pos = _ids_defaults(cfg, inputs, inputs_segmentation, inputs_position)
        x = Encoder(cfg, embed, name="encoder")(inputs, seg, pos, deterministic=deterministic)
        token_logits = embed.attend(x) if cfg.tie_output else dense(
            cfg.resolved_input_vocab_size, axes.EMBED, axes.VOCAB, use_bias=False,
            kernels=cfg.kernels, dtype=jnp.float32, param_dtype=cfg.param_dtype,
            name="token_head")(x)
        out = {"token_logits": token_logits}
        if cfg.num_classes:
            out["class_logits"] = self._classify(x, seg, deterministic)
        return out

    def _classify(self, x, seg, deterministic):
        """Mean over the first segment's tokens -> tanh pooler -> classes."""
        cfg = self.config
        weights = (seg == 1).astype(jnp.float32)[..., None]
        pooled = (x.astype(jnp.float32) * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)
        kw = dict(use_bias=True, kernels=cfg.kernels, dtype=cfg.dtype,
                  param_dtype=cfg.param_dtype)
        pooled = jnp.tanh(dense(cfg.d_model, axes.EMBED, axes.EMBED, name="pooler", **kw)(pooled))
        pooled = Dropout(cfg.dropout_rate)(pooled, deterministic=deterministic)
        head = dense(cfg.num_classes, axes.EMBED, axes.CLASSES, name="classifier", **kw)
        return head(pooled).astype(jnp.float32)

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
import numpy as np

from transformer_zoo.models import axes
from transformer_zoo.models.blocks import DecoderBlock, EncoderBlock
from transformer_zoo.models.config import ModelConfig
from transformer_zoo.models.decoding import NEG_INF
from transformer_zoo.models.dropout import Dropout
from transformer_zoo.models.embedding import Embed
from transformer_zoo.models.masks import AttentionMask
from transformer_zoo.models.mlp import ACTIVATIONS, dense
from transformer_zoo.models.norms import make_norm
from transformer_zoo.models.positional import LearnedPositionalEmbedding, sinusoidal_encoding
from transformer_zoo.models.variants import FfnActivation, NormPosition, Pooling, PositionEncoding

Array = Any

# The logit of an id outside ModelConfig.output_ids: finite (no inf - inf = NaN in a
# softmax), exp() of it is 0 in float32, and decoding takes it for "no hypothesis".
OUTPUT_MASK_VALUE = NEG_INF


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
    """Token embedding (x sqrt(D)) + absolute positions (+ token types), then dropout.

    With `embedding_norm`, the sum is normalised before dropout (BERT).
    """

    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, ids: Array, positions: Array, token_types: Array | None = None, *,
                 deterministic: bool) -> Array:
        cfg = self.config
        if cfg.position_encoding == PositionEncoding.LEARNED and ids.shape[1] > cfg.max_length:
            raise ValueError(f"sequence length {ids.shape[1]} > max_length={cfg.max_length}")
        x = self.embed(ids)
        if cfg.position_encoding in _SINUSOIDS:
            concat = cfg.position_encoding == PositionEncoding.SINUSOIDAL_CONCAT
            x = x + sinusoidal_encoding(positions, cfg.d_model, concat=concat).astype(cfg.dtype)
        elif cfg.position_encoding == PositionEncoding.LEARNED:
            table = LearnedPositionalEmbedding(cfg.max_length, cfg.d_model, cfg.param_dtype,
                                               name="pos_embedding")
            x = x + table(positions).astype(cfg.dtype)
        if cfg.type_vocab_size:
            types = jnp.zeros_like(ids) if token_types is None else token_types
            table = Embed(cfg.type_vocab_size, cfg.d_model, False, cfg.dtype, cfg.param_dtype,
                          name="type_embedding")
            x = x + table(types)
        if cfg.embedding_norm:
            x = make_norm(cfg.norm, cfg.norm_epsilon, cfg.dtype, cfg.param_dtype,
                          name="embedding_norm")(x)
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.EMBED))


_SINUSOIDS = (PositionEncoding.SINUSOIDAL, PositionEncoding.SINUSOIDAL_CONCAT)


def _output_bias(cfg: ModelConfig, module: nn.Module, logits: Array, vocab: int) -> Array:
    """logits + a learned [V] bias when config.output_bias (float32)."""
    if not cfg.output_bias:
        return logits
    return logits + _bias_param(cfg, module, vocab).astype(jnp.float32)


def restrict_logits(cfg: ModelConfig, logits: Array) -> Array:
    """logits [..., V] with every id outside config.output_ids at OUTPUT_MASK_VALUE."""
    if cfg.output_ids is None:
        return logits
    allowed = np.zeros(cfg.vocab_size, bool)
    allowed[list(cfg.output_ids)] = True
    return jnp.where(allowed, logits, jnp.asarray(OUTPUT_MASK_VALUE, logits.dtype))


def _bias_param(cfg: ModelConfig, module: nn.Module, vocab: int) -> Array:
    return module.param("logits_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                    (axes.VOCAB,)),
                        (vocab,), cfg.param_dtype)


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
    def __call__(self, inputs, segmentation, positions, token_types=None, *,
                 deterministic: bool = True):
        """inputs [B, S] (token_types [B, S] or None) -> encoded [B, S, D]."""
        cfg = self.config
        embedder = Embedder(cfg, self.embed, name="embedder")
        x = embedder(inputs, positions, token_types, deterministic=deterministic)
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
                 deterministic: bool = True, decode: bool = False, return_hidden: bool = False):
        """tokens [B, T] (already shifted) -> logits [B, T, V] float32.

        With return_hidden=True: the final states [B, T, D] that the output
        layer reads, for a loss that applies `output_weights` itself
        (train/chunked_loss.py); the output bias is still created at init.
        """
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
        if return_hidden:
            if cfg.output_bias:  # created here at init, read by output_weights
                _bias_param(cfg, self, cfg.vocab_size)
            return x
        if cfg.tie_output:
            logits = self.embed.attend(x, decode=decode)
        else:
            head = dense(cfg.vocab_size, axes.EMBED, axes.VOCAB, use_bias=False,
                         kernels=cfg.kernels, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                         name="logits")
            logits = head(x.astype(jnp.float32))
        return restrict_logits(cfg, _output_bias(cfg, self, logits, cfg.vocab_size))

    def output_weights(self) -> tuple[Array, Array]:
        """The tied output layer: (table [V, D], bias [V]; zeros without output_bias).

        The logits are hidden @ table^T + bias in float32. ValueError for an
        untied head (a dense layer whose kernel exists only once it is called).
        """
        cfg = self.config
        if not cfg.tie_output:
            raise ValueError("output_weights (return_hidden) needs tie_output=True: the "
                             "untied head has its own kernel")
        bias = (nn.meta.unbox(self.get_variable("params", "logits_bias")) if cfg.output_bias
                else jnp.zeros((cfg.vocab_size,), cfg.param_dtype))
        return self.embed.embedding, bias

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
               targets_position=None, *, deterministic: bool = True, decode: bool = False,
               return_hidden: bool = False):
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
                            deterministic=deterministic, decode=decode,
                            return_hidden=return_hidden)

    def __call__(self, inputs, targets, inputs_segmentation=None, targets_segmentation=None,
                 inputs_position=None, targets_position=None, *, deterministic: bool = True,
                 return_hidden: bool = False):
        """Teacher-forced logits [B, T, V] float32 for inputs [B, S], targets [B, T].

        return_hidden=True gives the final decoder states [B, T, D] instead,
        for a loss that applies `output_weights()` itself.
        """
        cfg = self.config
        in_seg, in_pos = _ids_defaults(cfg, inputs, inputs_segmentation, inputs_position)
        tgt_seg, tgt_pos = _ids_defaults(cfg, targets, targets_segmentation, targets_position)
        encoded = self.encode(inputs, in_seg, in_pos, deterministic=deterministic)
        decoder_tokens = shift_right(targets, cfg.bos_id, tgt_pos)
        return self.decode(encoded, in_seg, decoder_tokens, tgt_seg, tgt_pos,
                           deterministic=deterministic, return_hidden=return_hidden)

    def output_weights(self) -> tuple[Array, Array]:
        """(table [V, D], bias [V]) of the tied output layer (Decoder.output_weights)."""
        return self.decoder.output_weights()


class DecoderOnly(nn.Module):
    """GPT-style causal language model."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = _make_embed(cfg, cfg.vocab_size, "embed")
        self.decoder = Decoder(cfg, self.embed, cfg.num_decoder_layers, cross_attention=False)

    def __call__(self, targets, targets_segmentation=None, targets_position=None, *,
                 deterministic: bool = True, decode: bool = False, return_hidden: bool = False):
        """Logits [B, T, V] float32 (return_hidden=True: the final states [B, T, D]).

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
        return self.decoder(tokens, seg, pos, deterministic=deterministic,
                            return_hidden=return_hidden)

    def output_weights(self) -> tuple[Array, Array]:
        """(table [V, D], bias [V]) of the tied output layer (Decoder.output_weights)."""
        return self.decoder.output_weights()


class EncoderOnly(nn.Module):
    """Bidirectional encoder with a token-level head and a pooled classifier (BERT-style)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, inputs, inputs_segmentation=None, inputs_position=None, *,
                 token_types=None, deterministic: bool = True) -> dict[str, Array]:
        """The encoder's outputs for inputs [B, S].

        Args:
          inputs: [B, S] token ids.
          inputs_segmentation: [B, S] segment ids (default: 1 on tokens, 0 on PAD).
          inputs_position: [B, S] positions (default 0..S-1).
          token_types: [B, S] token-type ids (config.type_vocab_size; default 0).
          deterministic: disables dropout.

        Returns:
          {"hidden": [B, S, D] final encoder states, "token_logits": [B, S, V]
          float32}, plus "pooled" [B, D] with config.pooler or num_classes, and
          "class_logits" [B, C] float32 with num_classes.
        """
        cfg = self.config
        embed = _make_embed(cfg, cfg.resolved_input_vocab_size, "embed")
        seg, pos = _ids_defaults(cfg, inputs, inputs_segmentation, inputs_position)
        x = Encoder(cfg, embed, name="encoder")(inputs, seg, pos, token_types,
                                                deterministic=deterministic)
        out = {"hidden": x, "token_logits": self._token_logits(embed, x)}
        if cfg.num_classes or cfg.pooler:
            out["pooled"] = self._pool(x, seg)
        if cfg.num_classes:
            pooled = Dropout(cfg.dropout_rate)(out["pooled"], deterministic=deterministic)
            head = dense(cfg.num_classes, axes.EMBED, axes.CLASSES, name="classifier",
                         **self._dense_kw())
            out["class_logits"] = head(pooled).astype(jnp.float32)
        return out

    def _dense_kw(self) -> dict:
        cfg = self.config
        return dict(use_bias=True, kernels=cfg.kernels, dtype=cfg.dtype,
                    param_dtype=cfg.param_dtype)

    def _token_logits(self, embed: Embed, x: Array) -> Array:
        """[B, S, D] -> [B, S, V] float32 (BERT's MLM head with mlm_transform)."""
        cfg = self.config
        if cfg.mlm_transform:
            act, _ = ACTIVATIONS[FfnActivation(cfg.ffn_activation)]
            x = act(dense(cfg.d_model, axes.EMBED, axes.EMBED, name="mlm_dense",
                          **self._dense_kw())(x))
            x = make_norm(cfg.norm, cfg.norm_epsilon, cfg.dtype, cfg.param_dtype,
                          name="mlm_norm")(x)
        vocab = cfg.resolved_input_vocab_size
        logits = embed.attend(x) if cfg.tie_output else dense(
            vocab, axes.EMBED, axes.VOCAB, use_bias=False, kernels=cfg.kernels,
            dtype=jnp.float32, param_dtype=cfg.param_dtype, name="token_head")(x)
        return _output_bias(cfg, self, logits, vocab)

    def _pool(self, x, seg):
        """The first token, or the mean over the first segment's tokens -> tanh pooler."""
        cfg = self.config
        if cfg.pooling == Pooling.FIRST:
            pooled = x[:, 0].astype(jnp.float32)
        else:
            weights = (seg == 1).astype(jnp.float32)[..., None]
            pooled = (x.astype(jnp.float32) * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)
        pooler = dense(cfg.d_model, axes.EMBED, axes.EMBED, name="pooler", **self._dense_kw())
        return jnp.tanh(pooler(pooled))

"""Multi-head attention: self and cross, GQA/MQA, RoPE/ALiBi, KV cache.

    head_i = Attention(X_q W_i^Q, X_kv W_i^K, X_kv W_i^V)
    MultiHead(X_q, X_kv) = Concat(head_1, ..., head_N) W^O

Incremental decoding (`decode=True`) keeps a key/value cache in the "cache"
collection. The first call with decode=True (usually inside `init` or an
initialisation apply over a [B, S_max] dummy) only creates the cache; later
calls write their T new keys at `cache_index` and attend causally over the
cache (within `attention_window` when set, as the full pass does).
Cross-attention caches its projected keys/values on first use, so the encoder
output is projected once per source.

Attention capture: when the "intermediates" collection is mutable (see
models/capture.py), each call also sows its [B, N, T, S] weights there as
"attention_weights" (parameters and outputs unchanged); otherwise nothing
extra is computed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_zoo.models import axes, cpu_kernels
from transformer_zoo.models.dot_product import (
    alibi_bias,
    attention_dropout,
    dot_product_attention,
    kv_major_attention,
    masked_softmax,
    weighted_values,
)
from transformer_zoo.models.linear_attention import feature_map
from transformer_zoo.models.masks import AttentionMask
from transformer_zoo.models.positional import alibi_slopes, apply_rope
from transformer_zoo.models.projection import Projection
from transformer_zoo.models.variants import (
    AttentionImpl,
    Kernels,
    PositionEncoding,
    ScoreFn,
    parse,
    parse_attention_impl,
)

Array = Any


_Q_AXES = (axes.EMBED, axes.HEADS, axes.HEAD_DIM)
_KV_AXES = (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM)


def _proj(features, kernel_axes, *, axis=-1, name, **kw):
    in_dims = len(axis) if isinstance(axis, tuple) else 1
    return Projection(features, kernel_axes, in_dims, name=name, **kw)


class MultiHeadAttention(nn.Module):
    """Multi-head (and grouped-query) attention.

    Attributes:
      num_heads: N query heads.
      num_kv_heads: K key/value heads (None = N; 1 = multi-query).
      head_dim: d_k (None = D / N).
      v_head_dim: d_v (None = d_k).
      out_features: output width (None = input width D).
      use_bias: biases in the four projections.
      dropout_rate: dropout on the attention weights.
      score_fn: a `ScoreFn`: "dot" (scaled dot product) or "additive"
        (Bahdanau: v^T tanh(q + k)).
      position_encoding: a `PositionEncoding`: "rope" rotates q and k, "alibi"
        biases the scores; the others act on the embeddings, not here.
      rope_base: RoPE base frequency.
      attention_impl: a registered dot_product_attention implementation.
      attention_window: sliding window w of self-attention (None = none): a
        query sees keys w positions back when causal, w // 2 either way
        otherwise. In a full pass it is added to an `AttentionMask` mask that
        has no window; in decoding steps it applies over the cache slots.
      kernels: PORTABLE (plain JAX) or CPU (models/cpu_kernels.py).
      dtype: compute dtype.
      param_dtype: parameter dtype.
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = False
    dropout_rate: float = 0.0
    score_fn: ScoreFn = ScoreFn.DOT
    position_encoding: PositionEncoding = PositionEncoding.NONE
    rope_base: float = 10000.0
    attention_impl: AttentionImpl | str = AttentionImpl.XLA
    attention_window: int | None = None
    kernels: Kernels = Kernels.PORTABLE
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        parse(ScoreFn, self.score_fn, "MultiHeadAttention.score_fn")
        parse(PositionEncoding, self.position_encoding, "MultiHeadAttention.position_encoding")
        parse(Kernels, self.kernels, "MultiHeadAttention.kernels")
        parse_attention_impl(self.attention_impl, "MultiHeadAttention.attention_impl")
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"MultiHeadAttention.attention_window must be >= 1, got "
                             f"{self.attention_window}")
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Array | AttentionMask | None = None,
        q_positions: Array | None = None,
        kv_positions: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        return_weights: bool = False,
    ):
        """Attends from `inputs_q` to `inputs_kv` (itself when None).

        Args:
          inputs_q: [B, T, D].
          inputs_kv: [B, S, D] for cross-attention, None for self-attention.
          mask: bool mask (dense [B, 1|N, T, S] or AttentionMask; with
            attention_window, an AttentionMask or None); with decode=True a
            dense mask over the cache slots [B, 1|N, T, S_max].
          q_positions: [B|1, T] positions for RoPE (default 0..T-1, or the
            cache slots when decoding).
          kv_positions: [B|1, S] key positions for RoPE.
          deterministic: disables dropout.
          decode: incremental decoding with the KV cache.
          return_weights: also return the [B, N, T, S] attention weights (only
        attention_impl "xla" and "auto" return them, and additive scores and
        decoding steps always; the capture collection works with every impl).

        Returns:
          [B, T, out_features], and the weights if requested.
        """
        N, K, H, Hv = self._dims(inputs_q.shape[-1])
        kw = dict(use_bias=self.use_bias, kernels=self.kernels, dtype=self.dtype,
                  param_dtype=self.param_dtype)
        is_cross = inputs_kv is not None
        if is_cross:
            query = _proj((N, H), _Q_AXES, name="query", **kw)(inputs_q)
            key, value = self._cross_kv(inputs_kv, K, H, Hv, decode, kw)
        else:
            query, key, value = self._self_qkv(inputs_q, {"query": (N, H), "key": (K, H),
                                                          "value": (K, Hv)}, kw)
        if decode and not is_cross:
            query, key, value, mask = self._decode_step(query, key, value, mask, q_positions)
        elif not is_cross:
            mask = self._windowed(mask, query.shape[1])
        if not decode and self.position_encoding == PositionEncoding.ROPE and not is_cross:
            q_positions = _default_positions(q_positions, query)
            kv_positions = q_positions if kv_positions is None else kv_positions
            query = apply_rope(query, q_positions, self.rope_base)
            key = apply_rope(key, kv_positions, self.rope_base)
        query = nn.with_logical_constraint(
            query, (axes.BATCH, axes.LENGTH, axes.HEADS, axes.HEAD_DIM)
        )
        # While decoding, keys and values come head-major [B, K, S, H] from the cache.
        out = self._attend_or_capture(query, key, value, mask, is_cross, deterministic,
                                      return_weights, kv_major=decode)
        out, weights = out if return_weights else (out, None)
        out_features = self.out_features or inputs_q.shape[-1]
        out = _proj(out_features, (axes.HEADS, axes.HEAD_DIM, axes.EMBED), axis=(-2, -1),
                    name="out", **kw)(out)
        return (out, weights) if return_weights else out

    def _dims(self, d_model: int):
        N = self.num_heads
        K = N if self.num_kv_heads is None else self.num_kv_heads
        if N < 1 or K < 1:
            raise ValueError(f"num_heads={N} and num_kv_heads={K} must be positive")
        if N % K:
            raise ValueError(f"num_heads={N} is not divisible by num_kv_heads={K}")
        if self.head_dim is None and d_model % N:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={N}")
        H = self.head_dim or d_model // N
        if self.position_encoding == PositionEncoding.ROPE and H % 2:
            raise ValueError(f"position_encoding='rope' needs an even head_dim, got {H}")
        return N, K, H, self.v_head_dim or H

    def _windowed(self, mask, length: int):
        """The full pass's self-attention mask with `attention_window` applied."""
        window = self.attention_window
        if window is None or (isinstance(mask, AttentionMask) and mask.window == window):
            return mask
        if mask is None:
            positions = _default_positions(None, jnp.zeros((1, length)))
            return AttentionMask(q_positions=positions, kv_positions=positions, window=window)
        if not isinstance(mask, AttentionMask):
            raise ValueError("MultiHeadAttention.attention_window needs an AttentionMask (its "
                             "positions and causality place the window), got a dense mask array")
        if mask.window is not None:
            raise ValueError(f"mask.window={mask.window} disagrees with "
                             f"MultiHeadAttention.attention_window={window}")
        return dataclasses.replace(mask, window=window)

    def _self_qkv(self, x, shapes: dict[str, tuple[int, int]], kw):
        """Self-attention's query, key and value [B, T, heads, dim].

        In a CPU decoding step, one streamed product against the three kernels
        transposed and concatenated ("qkv_t", models/cpu_kernels.py): three
        products would share one broadcast of x, which XLA:CPU then stores.
        """
        projs = {name: _proj(shape, _Q_AXES if name == "query" else _KV_AXES, name=name,
                             streamable=False, **kw) for name, shape in shapes.items()}
        lead = x.shape[:-1]
        fused = None
        if self.kernels == Kernels.CPU and cpu_kernels.fits(math.prod(lead)):
            fused = cpu_kernels.read_decode_weight(self, "qkv_t")
        if fused is None:
            return tuple(proj(x) for proj in projs.values())
        y = cpu_kernels.streamed_matmul(x, fused).astype(self.dtype)
        outs, start = [], 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            part = y[..., start:start + size].reshape(*lead, *shape)
            start += size
            if self.use_bias:
                part = part + self._child_param(name, "bias").astype(self.dtype)
            outs.append(part)
        return tuple(outs)

    def _child_param(self, child: str, name: str) -> Array:
        """A projection's parameter, read without calling the projection."""
        return nn.meta.unbox(self.variables["params"][child][name])

    def _cross_kv(self, inputs_kv, K, H, Hv, decode, kw):
        """Projects the encoder output; with decode, once per source (cached)."""
        if decode and self.has_variable("cache", "cross_key"):
            return (self.get_variable("cache", "cross_key"),
                    self.get_variable("cache", "cross_value"))
        key = _proj((K, H), _KV_AXES, name="key", **kw)(inputs_kv)
        value = _proj((K, Hv), _KV_AXES, name="value", **kw)(inputs_kv)
        if decode:  # head-major like the self-attention cache
            key, value = _to_kv_major(key), _to_kv_major(value)
            self.variable("cache", "cross_key", lambda: key)
            self.variable("cache", "cross_value", lambda: value)
        return key, value

    def _decode_step(self, query, key, value, mask, q_positions):
        """Writes the new keys/values into the cache and attends over it."""
        initialised = self.has_variable("cache", "cached_key")
        # Head-major [B, K, S_max, H]: each step reads the cache without a transpose.
        cached_key = self.variable("cache", "cached_key", jnp.zeros, _kv_major_shape(key),
                                   key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                     _kv_major_shape(value), value.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        if isinstance(mask, AttentionMask):
            raise ValueError(
                "decode=True takes a dense mask over the cache slots, not an AttentionMask"
            )
        T = query.shape[1]
        slots = (cache_index.value + jnp.arange(T, dtype=jnp.int32))[None]
        if self.position_encoding == PositionEncoding.ROPE:
            positions = slots if q_positions is None else q_positions
            query = apply_rope(query, positions, self.rope_base)
            key = apply_rope(key, positions, self.rope_base)
        if not initialised:
            # The initialisation call only shapes the cache; attend causally.
            full = AttentionMask(q_positions=slots, kv_positions=slots, causal=True, dense=mask,
                                 window=self.attention_window)
            return query, _to_kv_major(key), _to_kv_major(value), full
        S_max = cached_key.value.shape[2]
        if mask is not None and mask.shape[-1] != S_max:
            raise ValueError(f"decode mask has {mask.shape[-1]} key slots, the cache has {S_max}")
        start = (0, 0, cache_index.value, 0)
        cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, _to_kv_major(key), start)
        cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, _to_kv_major(value),
                                                          start)
        cache_index.value = cache_index.value + T
        full = AttentionMask(
            q_positions=slots,
            kv_positions=jnp.arange(S_max, dtype=jnp.int32)[None],
            causal=True,
            dense=mask,
            window=self.attention_window,
        )
        return query, cached_key.value, cached_value.value, full

    def _attend_or_capture(self, query, key, value, mask, is_cross, deterministic,
                           return_weights, kv_major):
        """`_attend`; with "intermediates" mutable, also sows the [B, N, T, S] weights.

        Only a mutable "intermediates" collection (models/capture.py) computes
        weights the caller did not ask for, so every other call traces as
        before. The weights are the softmax before dropout: from `_attend`
        itself where it can return them (impl "xla", additive scores, decoding
        steps), else recomputed by the reference path (`_reference_weights`)
        while `attention_impl` still computes the output, unchanged.
        """
        if not self.is_mutable_collection("intermediates"):
            return self._attend(query, key, value, mask, is_cross, deterministic,
                                return_weights, kv_major=kv_major)
        native = (kv_major or self.score_fn == ScoreFn.ADDITIVE
                  or self.attention_impl == AttentionImpl.XLA)
        out = self._attend(query, key, value, mask, is_cross, deterministic,
                           return_weights or native, kv_major=kv_major)
        if native:
            out, weights = out
        else:
            out, weights = out if return_weights else (out, None)
            weights = self._reference_weights(query, key, value, mask, is_cross)
        self.sow("intermediates", "attention_weights", weights)
        return (out, weights) if return_weights else out

    def _reference_weights(self, query, key, value, mask, is_cross):
        """The weights an implementation that returns none attends with: [B, N, T, S].

        "linear" attends with phi(q).phi(k) normalised over the visible keys,
        not a softmax; every other implementation computes the softmax that
        the reference ("xla") materialises.
        """
        if self.attention_impl == AttentionImpl.LINEAR:
            return _linear_weights(query, key, mask)
        _, weights = dot_product_attention(query, key, value, mask=mask,
                                           alibi_slopes=self._slopes(is_cross),
                                           return_weights=True, impl=AttentionImpl.XLA)
        return weights

    def _slopes(self, is_cross):
        if self.position_encoding == PositionEncoding.ALIBI and not is_cross:
            return jnp.asarray(alibi_slopes(self.num_heads))
        return None

    def _attend(self, query, key, value, mask, is_cross, deterministic, return_weights,
                kv_major=False):
        slopes = self._slopes(is_cross)
        rng = None
        if not deterministic and self.dropout_rate > 0.0:
            rng = self.make_rng("dropout")
        if kv_major and self.score_fn == ScoreFn.DOT:
            # Decoding: few queries against a long cache; the reference path is
            # exact and its scores are only [B, N, T, S_max] with small T.
            return kv_major_attention(
                query, key, value, mask=mask, alibi_slopes=slopes,
                dropout_rate=self.dropout_rate if rng is not None else 0.0, dropout_rng=rng,
                return_weights=return_weights)
        if kv_major:
            key, value = jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2)
        if self.score_fn == ScoreFn.ADDITIVE:
            return self._additive(query, key, value, mask, slopes, rng, return_weights)
        return dot_product_attention(
            query, key, value, mask=mask, alibi_slopes=slopes, dropout_rate=self.dropout_rate,
            dropout_rng=rng, deterministic=deterministic, return_weights=return_weights,
            impl=self.attention_impl,
        )

    def _additive(self, query, key, value, mask, slopes, rng, return_weights):
        """Bahdanau scoring, e_ts = sum_h v_h tanh(q_th + k_sh), per head."""
        N, K = query.shape[2], key.shape[2]
        v = self.param(
            "additive_v",
            nn.with_logical_partitioning(nn.initializers.normal(query.shape[-1] ** -0.5),
                                         (axes.HEADS, axes.HEAD_DIM)),
            (N, query.shape[-1]),
            self.param_dtype,
        )
        k = jnp.repeat(key, N // K, axis=2).astype(jnp.float32)
        hidden = jnp.tanh(query.astype(jnp.float32)[:, :, None] + k[:, None])  # [B,T,S,N,H]
        scores = jnp.einsum("btsnh,nh->bnts", hidden, v.astype(jnp.float32))
        if slopes is not None:
            q_pos, kv_pos = _mask_positions(mask, query, key)
            scores = scores + alibi_bias(slopes, q_pos, kv_pos)
        dense = mask.dense_mask() if isinstance(mask, AttentionMask) else mask
        weights = masked_softmax(scores, dense)
        out = weighted_values(attention_dropout(weights, self.dropout_rate if rng is not None
                                                else 0.0, rng), value, query.dtype)
        return (out, weights) if return_weights else out


def _linear_weights(query, key, mask):
    """Linear attention's weights phi(q_t).phi(k_s) / sum_s' phi(q_t).phi(k_s'): [B, N, T, S].

    Its output is these weights times the values; rows with no visible key are 0.
    """
    N, K = query.shape[2], key.shape[2]
    fk = feature_map(jnp.repeat(key, N // K, axis=2))
    kernel = jnp.einsum("btnh,bsnh->bnts", feature_map(query), fk)
    if mask is not None:
        dense = mask.dense_mask() if isinstance(mask, AttentionMask) else mask
        kernel = jnp.where(dense, kernel, 0.0)
    total = kernel.sum(-1, keepdims=True)
    return kernel / jnp.where(total > 0, total, 1.0)


def _kv_major_shape(x):
    B, S, K, H = x.shape
    return (B, K, S, H)


def _to_kv_major(x):
    """[B, S, K, H] -> [B, K, S, H]."""
    return jnp.swapaxes(x, 1, 2)


def _default_positions(positions, x):
    if positions is not None:
        return positions
    return jnp.arange(x.shape[1], dtype=jnp.int32)[None]


def _mask_positions(mask, query, key):
    if isinstance(mask, AttentionMask):
        return mask.q_positions, mask.kv_positions
    return _default_positions(None, query), _default_positions(None, key)

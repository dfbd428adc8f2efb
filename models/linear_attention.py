"""Kernelised linear attention (Katharopoulos et al. 2020), O(T) in length.

With the feature map phi(x) = elu(x) + 1 the softmax kernel exp(q.k) is
replaced by phi(q).phi(k), so attention factorises:

    out_t = phi(q_t) (sum_s phi(k_s) v_s^T) / (phi(q_t) . sum_s phi(k_s))

over the keys s visible to t. Non-causal attention computes the two sums
once; causal attention carries them across chunks of C tokens in a
`lax.scan` (inside a chunk the C x C form is used), so memory is
O(T * C + H * Hv) per head and compute O(T * (C + H) * H).

The score `scale` is not used: phi is applied to the raw projections.

Masks: padding (segment id 0) zeroes the keys' features; packed segments are
honoured by resetting the carried sums where the segment changes, which
assumes each segment is contiguous (as packing produces) and, for causal
attention, that positions advance with the token index. ALiBi, dense masks,
windows and dropout have no linear-time form here and raise ValueError.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from transformer_zoo.models.dot_product import register_attention_impl
from transformer_zoo.models.masks import AttentionMask

Array = Any

DEFAULT_CHUNK = 128


def feature_map(x: Array) -> Array:
    """phi(x) = elu(x) + 1 > 0, in float32."""
    return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def linear_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: AttentionMask | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> Array:
    """Linear attention, causal if `mask.causal`.

    Args:
      query: [B, T, N, H].
      key: [B, S, K, H], N = K * G.
      value: [B, S, K, Hv].
      mask: None or an `AttentionMask` (segment ids, causal flag); causal or
        query segment ids need self-attention (T == S).
      chunk: chunk length C of the causal scan.

    Returns:
      [B, T, N, Hv] in the query dtype; rows with no visible key are 0.
    """
    _check_linear_mask(mask, query.shape[1], key.shape[1])
    B, T, N, H = query.shape
    K = key.shape[2]
    fq = feature_map(query).reshape(B, T, K, N // K, H)
    fk = feature_map(key)
    v = value.astype(jnp.float32)
    q_seg = None if mask is None else mask.q_segment_ids
    kv_seg = None if mask is None else mask.kv_segment_ids
    if mask is not None and (mask.causal or q_seg is not None):
        q_seg, kv_seg = _both_segments(q_seg, kv_seg, B, T)
        fk = fk * (kv_seg != 0)[:, :, None, None]
        num, den = _scan(fq, fk, v, q_seg, kv_seg, chunk, strict=False)
        if not mask.causal:
            # Keys after t: the same causal scan run backwards, diagonal excluded.
            rev = _scan(*(jnp.flip(x, 1) for x in (fq, fk, v, q_seg, kv_seg)), chunk, strict=True)
            num, den = num + jnp.flip(rev[0], 1), den + jnp.flip(rev[1], 1)
    else:
        num, den = _global(fq, fk, v, kv_seg)
    out = num / jnp.where(den > 0, den, 1.0)[..., None]
    return out.reshape(B, T, N, -1).astype(query.dtype)


def _check_linear_mask(mask, T: int, S: int) -> None:
    if mask is not None and not isinstance(mask, AttentionMask):
        raise ValueError("attention_impl='linear' takes an AttentionMask (segment ids, causal), "
                         "not a dense mask array: a dense [T,S] mask has no linear-time form")
    if mask is None:
        return
    if mask.window is not None or mask.dense is not None:
        raise ValueError("attention_impl='linear' supports neither AttentionMask.window "
                         f"(={mask.window}) nor AttentionMask.dense")
    if (mask.causal or mask.q_segment_ids is not None) and T != S:
        raise ValueError("attention_impl='linear' with causal=True or query segment ids needs "
                         f"self-attention (T == S); got T={T}, S={S}")


def _both_segments(q_seg, kv_seg, B: int, T: int):
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("attention_impl='linear' needs both q_segment_ids and kv_segment_ids "
                         "(or neither) for causal or packed attention")
    if q_seg is None:
        ones = jnp.ones((B, T), jnp.int32)
        return ones, ones
    return jnp.broadcast_to(q_seg, (B, T)), jnp.broadcast_to(kv_seg, (B, T))


def _global(fq: Array, fk: Array, v: Array, kv_seg: Array | None):
    """Non-causal, one segment: keys with segment 1 (or all) are visible."""
    if kv_seg is not None:
        # Without query segment ids every query is in segment 1.
        fk = fk * (kv_seg == 1)[:, :, None, None]
    kv = jnp.einsum("bskh,bskv->bkhv", fk, v)
    z = fk.sum(1)  # [B, K, H]
    num = jnp.einsum("btkgh,bkhv->btkgv", fq, kv)
    den = jnp.einsum("btkgh,bkh->btkg", fq, z)
    return num, den


def _chunked(x: Array, chunk: int) -> Array:
    """[B, T, ...] -> [nc, B, chunk, ...] (zero padded)."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, -x.shape[1] % chunk)
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[0], -1, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _scan(fq, fk, v, q_seg, kv_seg, chunk: int, strict: bool):
    """Causal numerator [B, T, K, G, Hv] and denominator [B, T, K, G].

    Key s is visible to query t when s <= t (s < t if `strict`) and both are
    in the same segment.
    """
    B, T, K, G, H = fq.shape
    chunk = min(chunk, T)
    xs = tuple(_chunked(x, chunk) for x in (fq, fk, v, q_seg, kv_seg))
    init = (
        jnp.zeros((B, K, H, v.shape[-1]), jnp.float32),
        jnp.zeros((B, K, H), jnp.float32),
        jnp.zeros((B,), q_seg.dtype),
    )
    tri = jnp.tril(jnp.ones((chunk, chunk), bool), -1 if strict else 0)
    _, (num, den) = lax.scan(lambda c, x: _chunk_step(c, x, tri), init, xs)
    num = jnp.moveaxis(num, 0, 1).reshape(B, -1, K, G, v.shape[-1])[:, :T]
    den = jnp.moveaxis(den, 0, 1).reshape(B, -1, K, G)[:, :T]
    return num, den


def _chunk_step(carry, xs, tri):
    """One chunk: the C x C form inside, the carried sums from before it.

    carry: kv [B, K, H, Hv] and z [B, K, H], the sums over the keys of the
    segment `cur` [B] that ends where this chunk starts.
    """
    kv, z, cur = carry
    fq, fk, v, q_seg, kv_seg = xs
    allowed = tri & (q_seg[:, :, None] == kv_seg[:, None, :])  # [B, C, C]
    a = jnp.einsum("bqkgh,bskh->bkgqs", fq, fk) * allowed[:, None, None]
    num = jnp.einsum("bkgqs,bskv->bqkgv", a, v)
    den = jnp.einsum("bkgqs->bqkg", a)
    same = (q_seg == cur[:, None]).astype(jnp.float32)  # [B, C]
    num = num + same[:, :, None, None, None] * jnp.einsum("bqkgh,bkhv->bqkgv", fq, kv)
    den = den + same[:, :, None, None] * jnp.einsum("bqkgh,bkh->bqkg", fq, z)
    # Carry only the last segment of this chunk (segments are contiguous).
    last = kv_seg[:, -1]
    w = (kv_seg == last[:, None]).astype(jnp.float32)
    cont = (last == cur).astype(jnp.float32)
    kv = cont[:, None, None, None] * kv + jnp.einsum("bskh,bskv,bs->bkhv", fk, v, w)
    z = cont[:, None, None] * z + jnp.einsum("bskh,bs->bkh", fk, w)
    return (kv, z, last), (num, den)


def _linear_impl(query, key, value, *, mask, bias, alibi_slopes, scale, dropout_rate,
                 dropout_rng, return_weights):
    del scale, dropout_rng  # phi replaces the scaled exponential; no dropout form.
    unsupported = {
        "bias": bias is not None,
        "alibi_slopes": alibi_slopes is not None,
        "dropout_rate > 0": dropout_rate > 0.0,
        "return_weights": return_weights,
    }
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"attention_impl='linear' does not support {', '.join(bad)}; "
                         "use attention_impl='xla' or 'blockwise'")
    return linear_attention(query, key, value, mask=mask)


register_attention_impl("linear", _linear_impl)

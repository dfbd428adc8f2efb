"""Accelerator attention kernels and the `auto` implementation that picks one.

* `cudnn`: `jax.nn.dot_product_attention(implementation='cudnn')` (NVIDIA GPU,
  float16/bfloat16).
* `pallas`: the flash-attention kernels shipped with JAX,
  `jax.experimental.pallas.ops.gpu.attention.mha` on GPU and
  `jax.experimental.pallas.ops.tpu.flash_attention` on TPU.
* `auto`: TPU -> pallas; GPU -> cudnn, else pallas, else blockwise; CPU ->
  blockwise for long key sequences (S >= AUTO_LONG_SEQUENCE), else xla. Falls
  back to blockwise/xla whenever a kernel cannot honour the call (dtype, mask,
  ALiBi, dropout, ...), and logs each distinct choice once.

The kernels only understand index-aligned masks: causality on token indices
(positions 0..T-1 and 0..S-1) and segment equality, so `AttentionMask`
positions are assumed to be the defaults. Each `_*_refusal` function returns
why a call is unsupported (a string) or None; the impls raise it as a
ValueError and `auto` uses it to fall through to the next candidate.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

import models.blockwise  # noqa: F401  (registers 'blockwise', which auto dispatches to)
from models.dot_product import dot_product_attention, register_attention_impl
from models.masks import AttentionMask

Array = Any

logger = logging.getLogger(__name__)

# On CPU the reference's [B, N, T, S] scores stop fitting in cache (and soon in
# memory) around here, and blockwise starts to win (benchmarks/attention.py).
AUTO_LONG_SEQUENCE = 2048

_PALLAS_BLOCK = 128
_logged: set[tuple[str, str]] = set()


def _mask_refusal(mask, allow_segments: bool) -> str | None:
    """Why an index-aligned kernel cannot take this mask (None if it can)."""
    if mask is None:
        return None
    if not isinstance(mask, AttentionMask):
        return "a dense mask array"
    if mask.window is not None or mask.dense is not None:
        return "AttentionMask.window/dense"
    if not allow_segments and (mask.q_segment_ids is not None or mask.kv_segment_ids is not None):
        return "segment ids"
    return None


def _common_refusal(call: dict) -> str | None:
    if call["bias"] is not None or call["alibi_slopes"] is not None:
        return "bias/alibi_slopes"
    if call["dropout_rate"] > 0.0 or call["return_weights"]:
        return "dropout or return_weights"
    return None


def _cudnn_refusal(query, key, value, call: dict) -> str | None:
    if jax.default_backend() != "gpu":
        return f"needs a CUDA GPU; jax.default_backend() is {jax.default_backend()!r}"
    if query.dtype not in (jnp.float16, jnp.bfloat16):
        return f"cuDNN flash attention needs float16/bfloat16, got {query.dtype}"
    if value.shape[-1] != query.shape[-1]:
        return "value head dim != query head dim"
    return _common_refusal(call) or _mask_refusal(call["mask"], allow_segments=False)


def _pallas_refusal(query, key, value, call: dict) -> str | None:
    backend = jax.default_backend()
    if backend not in ("gpu", "tpu"):
        return f"needs a GPU or TPU; jax.default_backend() is {backend!r}"
    if _pallas_kernel(backend) is None:
        return f"jax.experimental.pallas.ops.{backend} does not import here"
    if value.shape[-1] != query.shape[-1]:
        return "value head dim != query head dim"
    mask = call["mask"]
    if mask is not None and query.shape[1] != key.shape[1] and isinstance(mask, AttentionMask) \
            and mask.q_segment_ids is not None:
        return "segment ids with T != S"
    return _common_refusal(call) or _mask_refusal(mask, allow_segments=True)


def _pallas_kernel(backend: str):
    """The kernel module for `backend`, or None if it does not import."""
    try:
        if backend == "tpu":
            from jax.experimental.pallas.ops.tpu import flash_attention as kernel
        else:
            from jax.experimental.pallas.ops.gpu import attention as kernel
    except ImportError:
        return None
    return kernel


def _cudnn_attention(query, key, value, **call):
    """cuDNN fused attention via jax.nn.dot_product_attention."""
    reason = _cudnn_refusal(query, key, value, call)
    if reason:
        raise ValueError(f"attention_impl='cudnn' cannot run this call: {reason}")
    mask = call["mask"]
    return jax.nn.dot_product_attention(
        query, key, value, scale=call["scale"], is_causal=mask is not None and mask.causal,
        implementation="cudnn",
    )


def _segments(mask: AttentionMask | None, B: int, L: int, which: str) -> Array:
    ids = None if mask is None else getattr(mask, f"{which}_segment_ids")
    ids = jnp.ones((B, L), jnp.int32) if ids is None else jnp.broadcast_to(ids, (B, L))
    return ids.astype(jnp.int32)


def _pad_len(x: Array, axis: int, multiple: int) -> Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, widths)


def _pallas_attention(query, key, value, *, interpret: bool = False, **call):
    """Pallas flash attention (GPU mha or TPU flash_attention).

    Lengths are padded to the kernels' block multiple with segment id 0 (so
    no real query sees them); queries of segment 0 output zeros, as in xla.
    `interpret=True` runs the GPU kernel in the Pallas interpreter (tests).
    """
    backend = "gpu" if interpret else jax.default_backend()
    reason = None if interpret else _pallas_refusal(query, key, value, call)
    if reason:
        raise ValueError(f"attention_impl='pallas' cannot run this call: {reason}")
    mask = call["mask"]
    B, T, N, _ = query.shape
    S, K = key.shape[1], key.shape[2]
    q_seg, kv_seg = _segments(mask, B, T, "q"), _segments(mask, B, S, "kv")
    # The kernels want as many key heads as query heads.
    k, v = jnp.repeat(key, N // K, axis=2), jnp.repeat(value, N // K, axis=2)
    q, k, v = (_pad_len(x, 1, _PALLAS_BLOCK) for x in (query, k, v))
    q_seg, kv_seg = _pad_len(q_seg, 1, _PALLAS_BLOCK), _pad_len(kv_seg, 1, _PALLAS_BLOCK)
    causal = mask is not None and mask.causal
    kernel = _pallas_kernel(backend)
    if backend == "tpu":
        out = kernel.flash_attention(
            *(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
            segment_ids=kernel.SegmentIds(q_seg, kv_seg), causal=causal, sm_scale=call["scale"],
        ).transpose(0, 2, 1, 3)
    else:
        # The GPU kernel takes one segment-id array for queries and keys.
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"attention_impl='pallas' on GPU needs T == S, got T={T}, S={S}")
        out = kernel.mha(q, k, v, q_seg, sm_scale=call["scale"], causal=causal,
                         interpret=interpret)
    out = out[:, :T] * (q_seg[:, :T] != 0)[:, :, None, None]
    return out.astype(query.dtype)


def choose_impl(query, key, value, **call) -> tuple[str, str]:
    """The implementation `auto` runs for this call, and why."""
    backend = jax.default_backend()
    if call["return_weights"] or call["bias"] is not None:
        return "xla", "return_weights/bias need the materialised scores"
    if backend == "tpu" and not (r := _pallas_refusal(query, key, value, call)):
        return "pallas", "TPU"
    if backend == "gpu":
        cudnn_no = _cudnn_refusal(query, key, value, call)
        if not cudnn_no:
            return "cudnn", "GPU, cuDNN supports this call"
        pallas_no = _pallas_refusal(query, key, value, call)
        if not pallas_no:
            return "pallas", f"GPU, not cuDNN ({cudnn_no})"
        return "blockwise", f"GPU, not cuDNN ({cudnn_no}) nor Pallas ({pallas_no})"
    if backend == "tpu":
        return "blockwise", f"TPU, not Pallas ({r})"
    S = key.shape[1]
    if S >= AUTO_LONG_SEQUENCE:
        return "blockwise", f"{backend}, S={S} >= {AUTO_LONG_SEQUENCE}"
    return "xla", f"{backend}, S={S} < {AUTO_LONG_SEQUENCE}"


def _auto_attention(query, key, value, **call):
    name, reason = choose_impl(query, key, value, **call)
    if (name, reason) not in _logged:
        _logged.add((name, reason))
        logger.info("attention_impl='auto' runs %r: %s", name, reason)
    # Through the public entry point; dropout_rate is already 0 when deterministic.
    return dot_product_attention(query, key, value, deterministic=call["dropout_rate"] == 0.0,
                                 impl=name, **call)


register_attention_impl("cudnn", _cudnn_attention)
register_attention_impl("pallas", _pallas_attention)
register_attention_impl("auto", _auto_attention)

"""Accelerator attention kernels and the `auto` implementation that picks one.

* `cudnn`: `jax.nn.dot_product_attention(implementation='cudnn')` (NVIDIA GPU,
  float16/bfloat16). A host without cuDNN cannot even trace it: ValueError.
* `pallas`: the flash-attention kernels shipped with JAX,
  `jax.experimental.pallas.ops.gpu.attention.mha` on GPU and
  `jax.experimental.pallas.ops.tpu.flash_attention` on TPU; compiled for CPU,
  the GPU kernel runs in the Pallas interpreter (exact, slow: for tests).
* `auto`: per platform compiled for (`lax.platform_dependent`, so a program
  exported from a CPU host for GPU gets the GPU choice): TPU -> pallas; GPU ->
  cudnn, else pallas, else blockwise; CPU -> blockwise for long key sequences
  (S >= AUTO_LONG_SEQUENCE), else xla. Falls back to blockwise/xla whenever a
  kernel cannot honour the call (dtype, mask, ALiBi, dropout, ...) or cannot
  be traced on this host (cuDNN's call checks for the library), and logs each
  distinct choice once.

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
from jax import lax

import transformer_zoo.models.blockwise  # noqa: F401  (registers 'blockwise', which auto dispatches to)
from transformer_zoo.models.dot_product import dot_product_attention, register_attention_impl
from transformer_zoo.models.masks import AttentionMask

Array = Any

logger = logging.getLogger(__name__)

# On CPU the reference's [B, N, T, S] scores stop fitting in cache (and soon in
# memory) around here, and blockwise starts to win (benchmarks/attention.py).
AUTO_LONG_SEQUENCE = 2048

_PALLAS_BLOCK = 128
_logged: set[tuple[str, str, str]] = set()


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
    if query.dtype not in (jnp.float16, jnp.bfloat16):
        return f"cuDNN flash attention needs float16/bfloat16, got {query.dtype}"
    if value.shape[-1] != query.shape[-1]:
        return "value head dim != query head dim"
    return _common_refusal(call) or _mask_refusal(call["mask"], allow_segments=False)


def _pallas_refusal(query, key, value, call: dict, backend: str = "gpu") -> str | None:
    if _pallas_kernel(backend) is None:
        return f"jax.experimental.pallas.ops.{backend} does not import here"
    if value.shape[-1] != query.shape[-1]:
        return "value head dim != query head dim"
    if backend == "gpu" and query.shape[1] != key.shape[1]:
        return "the GPU kernel needs T == S"
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
    try:
        return jax.nn.dot_product_attention(
            query, key, value, scale=call["scale"], is_causal=mask is not None and mask.causal,
            implementation="cudnn",
        )
    except RuntimeError as error:  # raised while tracing where cuDNN is absent
        raise ValueError(f"attention_impl='cudnn' cannot run here: {error}") from None


def _segments(mask: AttentionMask | None, B: int, L: int, which: str) -> Array:
    ids = None if mask is None else getattr(mask, f"{which}_segment_ids")
    ids = jnp.ones((B, L), jnp.int32) if ids is None else jnp.broadcast_to(ids, (B, L))
    return ids.astype(jnp.int32)


def _pad_len(x: Array, axis: int, multiple: int) -> Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, widths)


def _pallas_attention(query, key, value, *, interpret: bool = False, **call):
    """Pallas flash attention: the TPU kernel compiled for TPU, else the GPU kernel.

    `interpret=True`, and any compilation for CPU, runs the GPU kernel in the
    Pallas interpreter. A call only the TPU kernel takes (T != S) compiles for
    TPU alone.
    """
    gpu_no = _pallas_refusal(query, key, value, call)
    tpu_no = "" if interpret else _pallas_refusal(query, key, value, call, "tpu")
    if gpu_no and (interpret or tpu_no):
        raise ValueError(f"attention_impl='pallas' cannot run this call: {gpu_no}")
    run = lambda backend, interp: lambda q, k, v: _pallas_kernel_call(q, k, v, backend, interp,
                                                                      call)
    if interpret:
        return run("gpu", True)(query, key, value)
    if gpu_no:
        return run("tpu", False)(query, key, value)
    branches = dict(cpu=run("gpu", True), default=run("gpu", False))
    if not tpu_no:
        branches["tpu"] = run("tpu", False)
    return lax.platform_dependent(query, key, value, **branches)


def _pallas_kernel_call(query, key, value, backend: str, interpret: bool, call: dict):
    """The `backend` kernel on [B, T, N, H] inputs, lengths padded to its block.

    Padding gets segment id 0 (so no real query sees it); queries of segment 0
    output zeros, as in xla.
    """
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


# The platforms `auto` distinguishes, as lax.platform_dependent names them.
AUTO_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def choose_impl(query, key, value, platform: str = "cpu", **call) -> tuple[str, str]:
    """The implementation `auto` runs for this call when compiled for `platform`, and why."""
    if call["return_weights"] or call["bias"] is not None:
        return "xla", "return_weights/bias need the materialised scores"
    if platform == "tpu":
        reason = _pallas_refusal(query, key, value, call, "tpu")
        if not reason:
            return "pallas", "TPU"
        return "blockwise", f"TPU, not Pallas ({reason})"
    if platform in ("cuda", "rocm"):
        cudnn_no = (_cudnn_refusal(query, key, value, call) if platform == "cuda"
                    else "not an NVIDIA GPU")
        if not cudnn_no:
            return "cudnn", "GPU, cuDNN supports this call"
        pallas_no = _pallas_refusal(query, key, value, call)
        if not pallas_no:
            return "pallas", f"GPU, not cuDNN ({cudnn_no})"
        return "blockwise", f"GPU, not cuDNN ({cudnn_no}) nor Pallas ({pallas_no})"
    S = key.shape[1]
    if S >= AUTO_LONG_SEQUENCE:
        return "blockwise", f"{platform}, S={S} >= {AUTO_LONG_SEQUENCE}"
    return "xla", f"{platform}, S={S} < {AUTO_LONG_SEQUENCE}"


def _run_choice(platform: str, call: dict):
    """The `auto` branch for `platform`: its choice, falling through the chain if the
    chosen kernel cannot be traced on this host."""

    def branch(query, key, value):
        name, reason = choose_impl(query, key, value, platform, **call)
        if name == "cudnn":
            try:
                return _run(name, reason, platform, query, key, value, call)
            except ValueError as error:  # no cuDNN on the tracing host
                name = "pallas" if not _pallas_refusal(query, key, value, call) else "blockwise"
                reason = f"GPU, cuDNN not traceable here ({error})"
        return _run(name, reason, platform, query, key, value, call)

    return branch


def _run(name, reason, platform, query, key, value, call):
    if (platform, name, reason) not in _logged:
        _logged.add((platform, name, reason))
        logger.info("attention_impl='auto' on %s runs %r: %s", platform, name, reason)
    if name == "pallas":  # this platform's kernel, as choose_impl checked it
        backend = "tpu" if platform == "tpu" else "gpu"
        return _pallas_kernel_call(query, key, value, backend, False, call)
    # Through the public entry point; dropout_rate is already 0 when deterministic.
    return dot_product_attention(query, key, value, deterministic=call["dropout_rate"] == 0.0,
                                 impl=name, **call)


def _auto_attention(query, key, value, **call):
    branches = {platform: _run_choice(platform, call) for platform in AUTO_PLATFORMS}
    return lax.platform_dependent(query, key, value, default=branches.pop("cpu"), **branches)


register_attention_impl("cudnn", _cudnn_attention)
register_attention_impl("pallas", _pallas_attention)
register_attention_impl("auto", _auto_attention)

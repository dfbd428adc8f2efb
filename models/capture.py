"""Attention capture: every layer's and head's attention weights, parameters unchanged.

    weights, out = capture_attention(model, params, inputs, targets)
    weights["decoder/layer_0/cross_attention"]  # [B, N, T, S]

Each MultiHeadAttention sows its weights into the "intermediates" collection
when that collection is mutable (models/attention.py); this module runs the
model with it mutable and names the weights by module path. Where they come
from, per `attention_impl`:

* "xla" (the reference), additive scores and decoding steps: the weights the
  call itself computes.
* "blockwise", "local", "cudnn", "pallas", "auto" and registered softmax
  implementations, which never materialise them: the reference path
  (`dot_product_attention(..., impl="xla", return_weights=True)`) on the same
  projected queries and keys, masks and ALiBi; the output is still computed
  by the configured implementation, so it is identical to an uncaptured call.
* "linear": its own kernel weights phi(q).phi(k), normalised over the visible
  keys (it has no softmax).

All are float32, before attention dropout; masked keys (padding, future
positions, outside the window) are 0 and a query with no visible key (a
padding query) has a row of zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import traverse_util

Array = Any

COLLECTION = "intermediates"
NAME = "attention_weights"


def capture_attention(model: nn.Module, params, *args: Any,
                      method: Callable[..., Any] | str | None = None,
                      **kwargs: Any) -> tuple[dict[str, Array], Any]:
    """Runs `model` and returns every attention module's weights with the output.

    Args:
      model: any module of the zoo (EncoderDecoder, DecoderOnly, EncoderOnly,
        a block or a MultiHeadAttention).
      params: its parameter tree (what `init(...)["params"]` holds).
      *args: the call's positional inputs, e.g. inputs [B, S] and targets [B, T].
      method: the method to run (default `__call__`), e.g. EncoderDecoder.encode.
      **kwargs: the call's keyword inputs (deterministic, segmentation, ...).

    Returns:
      ({path: weights [B, N, T, S] float32}, the model's output). Paths name the
      attention modules, e.g. "encoder/layer_0/self_attention",
      "decoder/layer_1/self_attention", "decoder/layer_1/cross_attention"
      (a bare MultiHeadAttention gives ""), ordered encoder before decoder,
      by layer number, self- before cross-attention. A module called more
      than once in the pass has its weights concatenated over T. Decoding
      steps (decode=True) need the "cache" collection mutable too, which this
      function does not make; capture a full (teacher-forced) pass instead.
    """
    out, state = model.apply({"params": params}, *args, method=method, mutable=[COLLECTION],
                             **kwargs)
    flat = traverse_util.flatten_dict(nn.meta.unbox(state.get(COLLECTION, {})))
    weights = {}
    for path, sown in flat.items():
        if path[-1] == NAME:
            weights["/".join(path[:-1])] = sown[0] if len(sown) == 1 else jnp.concatenate(
                sown, axis=2)
    return {name: weights[name] for name in sorted(weights, key=_order)}, out


# Where a path part sorts among its siblings: the order in which a forward pass runs them.
_RANK = {"encoder": 0, "decoder": 1, "self_attention": 0, "cross_attention": 1}


def _order(path: str) -> tuple:
    """A sort key for module paths: known parts by _RANK, layer_10 after layer_9."""
    parts = []
    for part in path.split("/"):
        stem, _, number = part.rpartition("_")
        index = int(number) if stem and number.isdigit() else -1
        parts.append((_RANK.get(part, 2), stem if index >= 0 else part, index))
    return tuple(parts)

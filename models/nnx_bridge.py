"""The zoo's linen modules as flax.nnx modules, through `nnx.bridge.ToNNX`.

NNX holds the variables in the module object: parameters (`nnx.Param`), the
KV cache (`nnx.Cache`) and the RNG streams (`nnx.Rngs`), so `nnx.jit`,
`nnx.grad` and `nnx.Optimizer` work on the module itself. The linen code is
reused unchanged; these functions cover what the bare bridge leaves to the
caller (tests/models/test_nnx.py, README "From flax.nnx"):

* `to_nnx` wraps and initialises a module from example inputs. It creates the
  parameters without eager sharding, so the logical axis names of the linen
  boxes (models/axes.py) stay as metadata on each `nnx.Param` whether or not a
  mesh is set (eager sharding would need a mesh and rules for every name, and
  fails on a parameter that repeats a name); `nnx.get_partition_spec` reads
  them back, and train/parallel.py maps them to a mesh as for linen.
* `init_cache` creates (or replaces) the decoding cache with the cache-creating
  `decode=True` call, and `decode_step` runs one cached step with the "cache"
  collection mutable. Both keep the cache as `nnx.Cache` variables of the
  module (`has_cache` tells whether there is one): nothing is kept elsewhere.
* `linen_variables` returns the module's variables as linen's `apply` takes
  them (boxes kept), for models/generate.py, checkpoints and train/parallel.py.

Dropout draws from the module's own `nnx.Rngs` (the "dropout" stream, or
"params"/"default" when there is none), which advances on every call: two
training calls differ, and `deterministic=True` calls are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.nnx import traversals
from flax.nnx.bridge import variables as bridge_variables

Array = Any

# Arguments the helpers set themselves: passing them too would be ambiguous.
_RESERVED = ("decode", "mutable")
_BRIDGE_ATTRS = ("to_nnx__", "_pytree__")


def to_nnx(module: nn.Module, *example_args: Any, rngs: nnx.Rngs,
           method: Callable[..., Any] | str | None = None,
           **example_kwargs: Any) -> nnx.bridge.ToNNX:
    """A linen module as an initialised NNX module.

    Runs the module once on the example inputs (like linen's `init`) with eager
    sharding off, so that it works the same with and without a mesh: the
    parameters keep their logical axis names as metadata and are placed on a
    mesh only when the caller does so.

    Args:
      module: a linen module of the zoo (MultiHeadAttention, EncoderDecoder, ...).
      *example_args: inputs of the initialising call, e.g. ids [B, L] or x [B, T, D].
      rngs: the RNG streams, e.g. `nnx.Rngs(params=0, dropout=1)`. The module
        keeps a fork of them: "params" (or "default") initialises, "dropout"
        (or "params" when absent) drives dropout in later training calls.
      method: the method to initialise through (default `__call__`).
      **example_kwargs: keyword inputs of the initialising call (e.g. `mask=`).

    Returns:
      An `nnx.bridge.ToNNX` module: call it like the linen module's `apply`
      (same arguments, `deterministic=False` for training), its methods too
      (`model.encode(...)`, `model.decode(...)`).

    Raises:
      TypeError: `module` is not a linen module or `rngs` not an `nnx.Rngs`.
      ValueError: `rngs` has no "params" or "default" stream, or the example
        call sets `decode` or `mutable` (the cache is `init_cache`'s job).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_nnx: module must be a flax.linen Module, got {type(module).__name__}")
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"to_nnx: rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    if "params" not in rngs and "default" not in rngs:
        raise ValueError("to_nnx: rngs has no 'params' (or 'default') stream to initialise "
                         f"the parameters; it has {sorted(name for name, _ in rngs.items())}")
    _check_reserved("to_nnx", example_kwargs,
                    "to_nnx only initialises parameters; create the KV cache with init_cache")
    model = nnx.bridge.ToNNX(module, rngs=rngs)
    with nnx.use_eager_sharding(False):
        nnx.bridge.lazy_init(model, *example_args, method=method, **example_kwargs)
    return model


def init_cache(model: nnx.bridge.ToNNX, *example_args: Any,
               method: Callable[..., Any] | str | None = None, **example_kwargs: Any) -> None:
    """Creates the decoding cache, replacing any earlier one.

    Runs the cache-creating call (`decode=True` on inputs of the final shape)
    whose output is discarded. The cache's key/value slots S_max are the length
    of the example ids / inputs; cross-attention caches the projections of the
    `encoded` it is given, so pass the real encoder output.

    Args:
      model: a module from `to_nnx`.
      *example_args: the cache-creating call's inputs: DecoderOnly ids [B, S_max];
        MultiHeadAttention x [B, S_max, D]; EncoderDecoder.decode (with
        `method="decode"`) encoded [B, S, D], source segmentation [B, S] and
        decoder ids [B, S_max].
      method: the method to decode through (EncoderDecoder: "decode").
      **example_kwargs: further keyword inputs of that call.

    Raises:
      TypeError: `model` is not an `nnx.bridge.ToNNX`.
      ValueError: the call sets `decode` or `mutable`, or created no cache
        (the module does not support decode=True).
    """
    _check_model("init_cache", model)
    _check_reserved("init_cache", example_kwargs, "init_cache sets decode=True itself")
    _drop_cache(model)
    model(*example_args, decode=True, mutable=["cache"], method=method, **example_kwargs)
    if not has_cache(model):
        raise ValueError(f"init_cache: {type(model.to_nnx__module).__name__} created no 'cache' "
                         "variables with decode=True; it does not support cached decoding")


def decode_step(model: nnx.bridge.ToNNX, *args: Any,
                method: Callable[..., Any] | str | None = None, **kwargs: Any) -> Array:
    """One cached decoding step: feeds tokens, appends their keys/values to the cache.

    Args:
      model: a module from `to_nnx` with a cache from `init_cache`.
      *args: the step's inputs as the linen module takes them with decode=True:
        DecoderOnly ids [B, T] (T new tokens: a prefill or one token);
        MultiHeadAttention x [B, T, D]; EncoderDecoder.decode (with
        `method="decode"`) encoded [B, S, D], source segmentation [B, S], ids [B, T].
      method: as given to `init_cache`.
      **kwargs: further keyword inputs (e.g. a [B, 1|N, T, S_max] `mask`).

    Returns:
      The call's output: logits [B, T, V] float32 for the families, [B, T, D]
      for MultiHeadAttention. The cache variables are updated in place.

    Raises:
      TypeError: `model` is not an `nnx.bridge.ToNNX`.
      ValueError: the model has no cache yet, or the call sets `decode` or
        `mutable`.
    """
    _check_model("decode_step", model)
    _check_reserved("decode_step", kwargs, "decode_step sets decode=True itself")
    if not has_cache(model):
        raise ValueError("decode_step: the model has no KV cache; call init_cache(model, ...) "
                         "with inputs of the full decoding length first")
    return model(*args, decode=True, mutable=["cache"], method=method, **kwargs)


def has_cache(model: nnx.bridge.ToNNX) -> bool:
    """Whether the model holds a decoding cache (any `nnx.Cache` variable)."""
    return bool(jax.tree.leaves(nnx.state(model, nnx.Cache)))


def linen_variables(model: nnx.bridge.ToNNX) -> dict[str, Any]:
    """The module's variables in linen's layout: {"params": ..., "cache": ...}.

    The parameters keep their logical-partitioning boxes, so the result works
    with `module.apply`, `nn.get_partition_spec` and train/parallel.py's
    `param_shardings`; `nn.meta.unbox` gives the plain arrays. The RNG
    streams are not included (linen takes keys per call).

    Args:
      model: a module from `to_nnx`.

    Returns:
      A dict from collection name to that collection's variable tree.
    """
    _check_model("linen_variables", model)
    attrs = {k: v for k, v in vars(model).items() if not k.startswith(_BRIDGE_ATTRS)}
    return bridge_variables.nnx_attrs_to_linen_vars(attrs)


def _drop_cache(model: nnx.bridge.ToNNX) -> None:
    """Removes every `nnx.Cache` variable, so the next decode=True call creates a new cache."""
    for name, value in list(vars(model).items()):
        if name.startswith(_BRIDGE_ATTRS):
            continue
        if isinstance(value, nnx.Cache):
            delattr(model, name)
        elif isinstance(value, dict):
            flat = traversals.flatten_mapping(value)
            kept = {k: v for k, v in flat.items() if not isinstance(v, nnx.Cache)}
            if len(kept) == len(flat):
                continue
            if kept:
                setattr(model, name, nnx.data(traversals.unflatten_mapping(kept)))
            else:
                delattr(model, name)


def _check_model(fn: str, model: Any) -> None:
    if not isinstance(model, nnx.bridge.ToNNX):
        raise TypeError(f"{fn}: expected a module from to_nnx (nnx.bridge.ToNNX), "
                        f"got {type(model).__name__}")


def _check_reserved(fn: str, kwargs: dict[str, Any], why: str) -> None:
    given = sorted(set(kwargs) & set(_RESERVED))
    if given:
        raise ValueError(f"{fn}: do not pass {', '.join(given)}: {why}")

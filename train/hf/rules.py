"""Name-and-layout rules between Hugging Face tensors and zoo parameters.

One `Rule` says which Hugging Face tensors become which zoo parameters and
how, in both directions, so import and export read the same table and cannot
drift apart. Zoo parameter paths are "/"-joined (e.g.
"encoder/layer_0/self_attention/query/kernel").

Layouts: torch `nn.Linear` stores weight [out, in]; GPT-2's `Conv1D` stores
[in, out]; zoo projections store kernel [*in_dims, *out_dims] (attention:
query [D, N, H], out [N, H, D]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from transformer_zoo.train.hf.weights import ConversionError


@dataclasses.dataclass(frozen=True)
class Rule:
    """`hf` tensors <-> `zoo` parameters.

    Attributes:
      hf: Hugging Face tensor names.
      zoo: zoo parameter paths.
      to_zoo: the `hf` arrays -> the `zoo` arrays (tuples, in order).
      to_hf: the inverse.
    """

    hf: tuple[str, ...]
    zoo: tuple[str, ...]
    to_zoo: Callable[..., tuple[np.ndarray, ...]]
    to_hf: Callable[..., tuple[np.ndarray, ...]]


def same(hf: str, zoo: str, zoo_shape: Sequence[int] | None = None,
         hf_shape: Sequence[int] | None = None) -> Rule:
    """One tensor, reshaped to `zoo_shape` in the zoo and to `hf_shape` in the folder."""
    def to_zoo(x):
        return (x.reshape(zoo_shape) if zoo_shape is not None else x,)

    def to_hf(x):
        return (x.reshape(hf_shape) if hf_shape is not None else x,)

    return Rule((hf,), (zoo,), to_zoo, to_hf)


def linear(hf: str, zoo: str, in_shape: Sequence[int], out_shape: Sequence[int], *,
           bias: bool = True, transposed: bool = True) -> list[Rule]:
    """A torch Linear (weight [out, in]; transposed=False: Conv1D's [in, out]) and its bias."""
    fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)

    def to_zoo(w):
        w = w.T if transposed else w
        return (w.reshape(*in_shape, *out_shape),)

    def to_hf(kernel):
        w = kernel.reshape(fan_in, fan_out)
        return (w.T if transposed else w,)

    rules = [Rule((f"{hf}.weight",), (f"{zoo}/kernel",), to_zoo, to_hf)]
    if bias:
        rules.append(same(f"{hf}.bias", f"{zoo}/bias", tuple(out_shape), (fan_out,)))
    return rules


def layer_norm(hf: str, zoo: str, names: tuple[str, str] = ("weight", "bias")) -> list[Rule]:
    """A LayerNorm's weight and bias as the zoo's scale and bias."""
    return [same(f"{hf}.{names[0]}", f"{zoo}/scale"), same(f"{hf}.{names[1]}", f"{zoo}/bias")]


def fused_qkv(hf: str, zoo: str, d_model: int, num_heads: int, head_dim: int) -> list[Rule]:
    """GPT-2's c_attn (Conv1D [D, 3 N H] and bias [3 N H]) as query, key, value."""
    split = (num_heads, head_dim)

    def weight_to_zoo(w):
        return tuple(p.reshape(d_model, *split) for p in np.split(w, 3, axis=1))

    def weight_to_hf(*kernels):
        return (np.concatenate([k.reshape(d_model, -1) for k in kernels], axis=1),)

    def bias_to_zoo(b):
        return tuple(p.reshape(split) for p in np.split(b, 3))

    def bias_to_hf(*biases):
        return (np.concatenate([b.reshape(-1) for b in biases]),)

    names = ("query", "key", "value")
    return [Rule((f"{hf}.weight",), tuple(f"{zoo}/{n}/kernel" for n in names),
                 weight_to_zoo, weight_to_hf),
            Rule((f"{hf}.bias",), tuple(f"{zoo}/{n}/bias" for n in names),
                 bias_to_zoo, bias_to_hf)]


def attention(hf: str, zoo: str, d_model: int, num_heads: int, head_dim: int,
              names: Mapping[str, str]) -> list[Rule]:
    """Four torch Linear projections (names: zoo "query"/"key"/"value"/"out" -> hf)."""
    heads = (num_heads, head_dim)
    rules = []
    for part in ("query", "key", "value"):
        rules += linear(f"{hf}.{names[part]}", f"{zoo}/{part}", (d_model,), heads)
    return rules + linear(f"{hf}.{names['out']}", f"{zoo}/out", heads, (d_model,))


# ---------------------------------------------------------------------------- applying rules


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """{"a/b/c": leaf} of a nested mapping."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, path + "/"))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def expected_hf_shapes(rules: Sequence[Rule], zoo_shapes: Mapping[str, tuple]) -> dict:
    """The Hugging Face shape each rule expects, from the zoo model's parameter shapes."""
    shapes = {}
    for rule in rules:
        # Zero-stride stand-ins: reshapes and transposes cost no memory.
        fakes = [np.broadcast_to(np.zeros((), np.float32), zoo_shapes[p]) for p in rule.zoo]
        for name, array in zip(rule.hf, rule.to_hf(*fakes), strict=True):
            shapes[name] = tuple(array.shape)
    return shapes


def to_zoo_params(rules: Sequence[Rule], tensors: Mapping[str, np.ndarray],
                  zoo_shapes: Mapping[str, tuple], where: str) -> dict:
    """The zoo parameter tree the `tensors` describe, checked name by name and shape by shape.

    Args:
      rules: the architecture's rules for this config.
      tensors: Hugging Face tensors by name (prefixes already normalised).
      zoo_shapes: the model's parameter shapes by path (from jax.eval_shape).
      where: the file named in errors.

    Raises:
      ConversionError: a tensor is missing, has a shape the config does not
        give, or a zoo parameter is covered by no rule.
    """
    want = expected_hf_shapes(rules, zoo_shapes)
    missing = [n for n in want if n not in tensors]
    if missing:
        raise ConversionError(f"{where} lacks {len(missing)} tensor(s) that config.json implies, "
                              f"e.g. {missing[:3]}")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ConversionError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"but config.json implies {shape}")
    flat = {}
    for rule in rules:
        arrays = rule.to_zoo(*(np.asarray(tensors[n]) for n in rule.hf))
        flat.update({p: np.ascontiguousarray(a, np.float32) for p, a in zip(rule.zoo, arrays,
                                                                            strict=True)})
    uncovered = sorted(set(zoo_shapes) - set(flat))
    if uncovered:
        raise ConversionError(f"no rule fills the zoo parameters {uncovered[:3]}")
    return unflatten(flat)


def to_hf_tensors(rules: Sequence[Rule], params: Mapping) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of a zoo parameter tree (float32 arrays)."""
    flat = {k: np.asarray(v, np.float32) for k, v in flatten(params).items()}
    unused = sorted(set(flat) - {p for rule in rules for p in rule.zoo})
    if unused:
        raise ConversionError(f"the architecture has no place for the zoo parameters {unused[:3]}")
    out = {}
    for rule in rules:
        arrays = rule.to_hf(*(flat[p] for p in rule.zoo))
        out.update({n: np.ascontiguousarray(a) for n, a in zip(rule.hf, arrays, strict=True)})
    return out

"""What every converted architecture provides, and the checks they share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from transformer_zoo.models import FfnActivation, ModelConfig
from transformer_zoo.train.cli import brief
from transformer_zoo.train.hf.rules import Rule
from transformer_zoo.train.hf.weights import ConversionError
from transformer_zoo.train.tasks import Family

# Hugging Face activation names (transformers.activations.ACT2FN) -> ours.
ACTIVATIONS = {
    "gelu": FfnActivation.GELU_EXACT,
    "gelu_new": FfnActivation.GELU,
    "gelu_pytorch_tanh": FfnActivation.GELU,
    "swish": FfnActivation.SILU,
    "silu": FfnActivation.SILU,
    "relu": FfnActivation.RELU,
}
# Ours -> the name written on export.
ACTIVATION_NAMES = {FfnActivation.GELU_EXACT: "gelu", FfnActivation.GELU: "gelu_new",
                    FfnActivation.SILU: "swish", FfnActivation.RELU: "relu"}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture (config.json `model_type`) and its zoo family.

    Attributes:
      model_type: config.json's model_type.
      family: the zoo family it converts into.
      config_from_hf: (config.json, tensor names) -> ModelConfig.
      config_to_hf: ModelConfig -> config.json (ConversionError if it does not fit).
      rules: ModelConfig -> the tensor rules, named as the Hugging Face class that
        the config implies saves them (e.g. BertForMaskedLM with mlm_transform).
      normalise: (tensor names, ModelConfig) -> {exported name: name in the file},
        dropping the buffers and tied copies that the file may hold.
    """

    model_type: str
    family: Family
    config_from_hf: Callable[[Mapping, set[str]], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    rules: Callable[[ModelConfig], list[Rule]]
    normalise: Callable[[set[str], ModelConfig], dict[str, str]]


def activation(hf_config: Mapping, key: str) -> FfnActivation:
    name = hf_config.get(key)
    if name not in ACTIVATIONS:
        raise ConversionError(f"config.json {key}={name!r} is not supported; supported: "
                              f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def require(hf_config: Mapping, key: str, allowed, default=None):
    """config.json[key] (or `default`), which must be in `allowed`."""
    value = hf_config.get(key, default)
    if value not in allowed:
        raise ConversionError(f"config.json {key}={value!r} is not supported (only {allowed})")
    return value


def number(hf_config: Mapping, key: str, default=None):
    """config.json[key], which must be present (or have a default)."""
    value = hf_config.get(key, default)
    if value is None:
        raise ConversionError(f"config.json has no {key!r}")
    return value


def check_exportable(cfg: ModelConfig, what: str, **wanted) -> None:
    """ConversionError naming every ModelConfig field that `what` cannot represent."""
    wrong = {k: brief(getattr(cfg, k)) for k, v in wanted.items()
             if (getattr(cfg, k) not in v if isinstance(v, tuple) else getattr(cfg, k) != v)}
    if wrong:
        needed = {k: wanted[k] for k in wrong}
        raise ConversionError(f"this model cannot be written as {what}: it has {wrong}, "
                              f"{what} needs {needed}")


def exportable_activation(cfg: ModelConfig, what: str) -> str:
    if cfg.ffn_activation not in ACTIVATION_NAMES:
        raise ConversionError(f"this model cannot be written as {what}: ffn_activation="
                              f"{str(cfg.ffn_activation)!r}; {what} takes "
                              f"{sorted(map(str, ACTIVATION_NAMES))}")
    return ACTIVATION_NAMES[cfg.ffn_activation]

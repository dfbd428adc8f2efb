"""Model families as tasks: which model a run builds and how a batch becomes a loss.

One small typed object per family (`EncoderDecoderTask`, `DecoderOnlyTask`,
`EncoderOnlyTask`), chosen once from the config with `get_task(config.family)`:
it builds the model, makes an initialisation batch, and maps a data/ batch
(dict of [B, L] int arrays) to (logits, targets, weights), calling the model
with keyword arguments, so train_step and eval_step stay family-agnostic.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from transformer_zoo.configs import schema
from transformer_zoo.models import DecoderOnly, EncoderDecoder, EncoderOnly, ModelConfig
from transformer_zoo.models.variants import parse

Array = Any


class Family(enum.StrEnum):
    ENCODER_DECODER = "encoder_decoder"  # translation (the paper)
    DECODER_ONLY = "decoder_only"  # language model
    ENCODER_ONLY = "encoder_only"  # token and sequence classification


def _ids(batch_size: int, length: int) -> tuple[Array, Array]:
    ids = jnp.ones((batch_size, length), jnp.int32)
    return ids, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)


def _weights(batch, feature: str) -> Array:
    seg = batch.get(f"{feature}_segmentation")
    ids = batch[feature]
    return ((seg if seg is not None else ids) != 0).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Task:
    """What train/ needs to know about a family (subclassed once per family).

    `features` are the model's token inputs in the order of its call; each
    comes with optional `<feature>_segmentation` and `<feature>_position`
    arrays of the same shape, which `model_inputs` passes by keyword.
    """

    family: ClassVar[Family]
    model_class: ClassVar[type[nn.Module]]
    features: ClassVar[tuple[str, ...]]
    generates: ClassVar[bool]  # decodes text (translation, continuation)

    def build(self, model_config: ModelConfig) -> nn.Module:
        """The family's linen module."""
        return self.model_class(model_config)

    def dummy_batch(self, batch_size: int = 1, length: int = 8) -> dict[str, Array]:
        """Model inputs of the right structure for initialisation (no labels)."""
        ids, pos = _ids(batch_size, length)
        return {key: value for f in self.features for key, value in
                ((f, ids), (f"{f}_segmentation", ids), (f"{f}_position", pos))}

    def model_inputs(self, batch) -> dict[str, Array]:
        """The model's keyword arguments from a data/ batch (None where absent)."""
        return {key: batch[key] if key == f else batch.get(key) for f in self.features
                for key in (f, f"{f}_segmentation", f"{f}_position")}

    def forward(self, model, params, batch, *, deterministic: bool, rngs=None):
        """(logits [B, T, C] float32, targets [B, T], weights [B, T]) for the loss:
        next-token prediction of the targets (the generating families)."""
        logits = model.apply({"params": params}, **self.model_inputs(batch),
                             deterministic=deterministic, rngs=rngs)
        return logits, batch["targets"], _weights(batch, "targets")

    def forward_hidden(self, model, params, batch, *, deterministic: bool, rngs=None):
        """(hidden [B, T, D], (table [V, D], bias [V]), targets [B, T], weights [B, T]):
        `forward` stopped before the tied output layer, for train/chunked_loss.py."""
        variables = {"params": params}
        hidden = model.apply(variables, **self.model_inputs(batch), deterministic=deterministic,
                             rngs=rngs, return_hidden=True)
        head = model.apply(variables, method="output_weights")
        return hidden, head, batch["targets"], _weights(batch, "targets")


@dataclasses.dataclass(frozen=True)
class EncoderDecoderTask(Task):
    family: ClassVar[Family] = Family.ENCODER_DECODER
    model_class: ClassVar[type[nn.Module]] = EncoderDecoder
    features: ClassVar[tuple[str, ...]] = ("inputs", "targets")
    generates: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class DecoderOnlyTask(Task):
    family: ClassVar[Family] = Family.DECODER_ONLY
    model_class: ClassVar[type[nn.Module]] = DecoderOnly
    features: ClassVar[tuple[str, ...]] = ("targets",)
    generates: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class EncoderOnlyTask(Task):
    family: ClassVar[Family] = Family.ENCODER_ONLY
    model_class: ClassVar[type[nn.Module]] = EncoderOnly
    features: ClassVar[tuple[str, ...]] = ("inputs",)
    generates: ClassVar[bool] = False

    def forward(self, model, params, batch, *, deterministic: bool, rngs=None):
        """Token labels [B, S], or one class per sequence when `labels` is [B]."""
        out = model.apply({"params": params}, **self.model_inputs(batch),
                          deterministic=deterministic, rngs=rngs)
        labels = batch["labels"]
        if labels.ndim == 1:  # sequence classification
            return out["class_logits"][:, None], labels[:, None], jnp.ones(labels[:, None].shape)
        return out["token_logits"], labels, _weights(batch, "inputs")

    def forward_hidden(self, model, params, batch, *, deterministic: bool, rngs=None):
        raise ValueError("train.loss_chunks needs a generating family (encoder_decoder or "
                         "decoder_only); encoder_only's heads are not the tied table")


TASKS: dict[Family, Task] = {t.family: t for t in (EncoderDecoderTask(), DecoderOnlyTask(),
                                                   EncoderOnlyTask())}
# The families by name, for messages and checks of config.family.
FAMILIES = tuple(f.value for f in Family)


def get_task(family: Family | str | Task) -> Task:
    """The task of `family` (a Family, its name, or already a Task); ValueError otherwise."""
    if isinstance(family, Task):
        return family
    return TASKS[parse(Family, family, "family")]


def build_model(family: Family | str | Task, model_config: ModelConfig) -> nn.Module:
    """The linen module of `family`."""
    return get_task(family).build(model_config)


def model_config_from(run_model_cfg, vocab_size: int, *, kernels=None,
                      special_ids: dict[str, int] | None = None,
                      output_ids: tuple[int, ...] | None = None) -> ModelConfig:
    """ModelConfig from the run config's `model` section, the tokenizer and the devices.

    Args:
      run_model_cfg: the `model` section (configs/schema.py: ModelConfig's fields).
      vocab_size: the tokenizer's vocabulary size; model.vocab_size None takes it.
      kernels: the devices' choice of models.Kernels, taken where model.kernels is
        None (an explicit value is honoured); None = ModelConfig's default.
      special_ids: the tokenizer's {"pad_id", "bos_id", "eos_id"}, taken where
        the section leaves them None; None = ModelConfig's defaults (the ids of
        this zoo's own tokenizers).
      output_ids: the ids the output layer scores (data.output_vocab's target
        side); None = all.

    Raises:
      ValueError: a key that is not a ModelConfig field, or a model.vocab_size
        that is not the tokenizer's.
    """
    fields = schema.checked(run_model_cfg, schema.MODEL_FIELDS, "model", "models.ModelConfig")
    if fields["vocab_size"] not in (None, vocab_size):
        raise ValueError(f"model.vocab_size={fields['vocab_size']} is not the tokenizer's "
                         f"vocabulary size {vocab_size}; leave it unset (None) to take it")
    fields["vocab_size"] = vocab_size
    fields["output_ids"] = output_ids
    if fields["kernels"] is None:
        fields["kernels"] = ModelConfig.kernels if kernels is None else kernels
    for name in ("pad_id", "bos_id", "eos_id"):
        if fields[name] is None:
            fields[name] = (special_ids or {}).get(name, getattr(ModelConfig, name))
    return ModelConfig(**fields)

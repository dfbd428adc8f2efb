"""Family glue: which model a run builds and how a batch becomes a loss.

Each family maps a data/ batch (dict of [B, L] int arrays) to logits,
targets and weights, so train_step and eval_step stay family-agnostic.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from transformer_zoo.configs import schema
from transformer_zoo.models import DecoderOnly, EncoderDecoder, EncoderOnly, ModelConfig

Array = Any

FAMILIES = {
    "encoder_decoder": EncoderDecoder,
    "decoder_only": DecoderOnly,
    "encoder_only": EncoderOnly,
}


def build_model(family: str, model_config: ModelConfig):
    """The linen module of `family`."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; choose from {sorted(FAMILIES)}")
    return FAMILIES[family](model_config)


def model_config_from(run_model_cfg, vocab_size: int, *, kernels=None) -> ModelConfig:
    """ModelConfig from the run config's `model` section, the tokenizer and the devices.

    Args:
      run_model_cfg: the `model` section (configs/schema.py: ModelConfig's fields).
      vocab_size: the tokenizer's vocabulary size; model.vocab_size None takes it.
      kernels: the devices' choice of models.Kernels, taken where model.kernels is
        None (an explicit value is honoured); None = ModelConfig's default.

    Raises:
      ValueError: a key that is not a ModelConfig field, or a model.vocab_size
        that is not the tokenizer's.
    """
    fields = schema.checked(run_model_cfg, schema.MODEL_FIELDS, "model", "models.ModelConfig")
    if fields["vocab_size"] not in (None, vocab_size):
        raise ValueError(f"model.vocab_size={fields['vocab_size']} is not the tokenizer's "
                         f"vocabulary size {vocab_size}; leave it unset (None) to take it")
    fields["vocab_size"] = vocab_size
    if fields["kernels"] is None:
        fields["kernels"] = ModelConfig.kernels if kernels is None else kernels
    return ModelConfig(**fields)


def dummy_batch(family: str, batch_size: int = 1, length: int = 8) -> dict[str, Array]:
    """Model inputs of the right structure for initialisation (no labels)."""
    ids = jnp.ones((batch_size, length), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
    if family == "encoder_decoder":
        return dict(inputs=ids, targets=ids, inputs_segmentation=ids, targets_segmentation=ids,
                    inputs_position=pos, targets_position=pos)
    if family == "decoder_only":
        return dict(targets=ids, targets_segmentation=ids, targets_position=pos)
    return dict(inputs=ids, inputs_segmentation=ids, inputs_position=pos)


def forward(model, family: str, params, batch, *, deterministic: bool, rngs=None):
    """(logits [B, T, C] float32, targets [B, T], weights [B, T]) for the loss."""
    variables = {"params": params}
    if family == "encoder_decoder":
        logits = model.apply(
            variables, batch["inputs"], batch["targets"], batch.get("inputs_segmentation"),
            batch.get("targets_segmentation"), batch.get("inputs_position"),
            batch.get("targets_position"), deterministic=deterministic, rngs=rngs,
        )
        return logits, batch["targets"], _weights(batch, "targets")
    if family == "decoder_only":
        logits = model.apply(variables, batch["targets"], batch.get("targets_segmentation"),
                             batch.get("targets_position"), deterministic=deterministic, rngs=rngs)
        return logits, batch["targets"], _weights(batch, "targets")
    out = model.apply(variables, batch["inputs"], batch.get("inputs_segmentation"),
                      batch.get("inputs_position"), deterministic=deterministic, rngs=rngs)
    labels = batch["labels"]
    if labels.ndim == 1:  # sequence classification
        return out["class_logits"][:, None], labels[:, None], jnp.ones(labels[:, None].shape)
    return out["token_logits"], labels, _weights(batch, "inputs")


def _weights(batch, feature: str) -> Array:
    seg = batch.get(f"{feature}_segmentation")
    ids = batch[feature]
    return ((seg if seg is not None else ids) != 0).astype(jnp.float32)

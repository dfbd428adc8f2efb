"""train/tasks.py: one typed task per model family, chosen once from config.family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_zoo.models import ModelConfig
from transformer_zoo.train.tasks import (
    DecoderOnlyTask,
    EncoderDecoderTask,
    EncoderOnlyTask,
    Family,
    get_task,
)

CONFIG = ModelConfig(vocab_size=16, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1,
                     num_decoder_layers=1, dropout_rate=0.0, num_classes=3, max_length=16)


@pytest.mark.parametrize("family,cls", [("encoder_decoder", EncoderDecoderTask),
                                        ("decoder_only", DecoderOnlyTask),
                                        ("encoder_only", EncoderOnlyTask)])
def test_each_family_has_its_task_and_the_task_its_model(family, cls):
    task = get_task(family)
    assert isinstance(task, cls) and task.family == family and get_task(Family(family)) is task
    assert get_task(task) is task
    assert type(task.build(CONFIG)) is cls.model_class
    assert task.generates == (family != "encoder_only")


def test_unknown_or_miscased_families_are_refused_with_the_choices():
    for bad in ("Encoder_Decoder", "seq2seq"):
        with pytest.raises(ValueError, match=rf"family='{bad}' is unknown; choose from "
                                             r"\['encoder_decoder', 'decoder_only'"):
            get_task(bad)


def _batch(family: str) -> dict:
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 16, (2, 6)), jnp.int32).at[1, 4:].set(0)
    seg = (ids != 0).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), ids.shape)
    if family == "encoder_decoder":
        return dict(inputs=ids, targets=ids[:, ::-1], inputs_segmentation=seg,
                    targets_segmentation=seg[:, ::-1], inputs_position=pos, targets_position=pos)
    if family == "decoder_only":
        return dict(targets=ids, targets_segmentation=seg, targets_position=pos)
    return dict(inputs=ids, inputs_segmentation=seg, inputs_position=pos,
                labels=jnp.array([0, 2]))


@pytest.mark.parametrize("family", [f.value for f in Family])
def test_forward_calls_the_model_by_keyword_and_weights_skip_padding(family):
    task = get_task(family)
    model = task.build(CONFIG)
    batch = _batch(family)
    params = model.init(jax.random.key(0), **task.dummy_batch(2, 6))["params"]
    logits, targets, weights = task.forward(model, params, batch, deterministic=True)
    # The same call written positionally, in the order of the model's signature.
    if family == "encoder_decoder":
        want = model.apply({"params": params}, batch["inputs"], batch["targets"],
                           batch["inputs_segmentation"], batch["targets_segmentation"],
                           batch["inputs_position"], batch["targets_position"])
        np.testing.assert_array_equal(weights, batch["targets_segmentation"] != 0)
    elif family == "decoder_only":
        want = model.apply({"params": params}, batch["targets"], batch["targets_segmentation"],
                           batch["targets_position"])
        np.testing.assert_array_equal(weights, batch["targets_segmentation"] != 0)
    else:  # sequence classification: one target per row
        out = model.apply({"params": params}, batch["inputs"], batch["inputs_segmentation"],
                          batch["inputs_position"])
        want = out["class_logits"][:, None]
        np.testing.assert_array_equal(targets, batch["labels"][:, None])
    np.testing.assert_allclose(logits, want, rtol=1e-6, atol=1e-6)

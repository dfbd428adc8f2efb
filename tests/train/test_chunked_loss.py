"""train/chunked_loss.py: the tied output layer and the loss by pieces of the length.

Checked against the loss written out on materialised logits with jax.nn, a
float64 numpy computation of the metric sums, and a whole train step with the
chunked loss against the one on the model's logits.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.train import tiny_config
from transformer_zoo.configs import schema
from transformer_zoo.models import ModelConfig
from transformer_zoo.models.variants import Kernels
from transformer_zoo.train.chunked_loss import chunked_output_loss
from transformer_zoo.train.state import create_train_state
from transformer_zoo.train.step import make_train_step
from transformer_zoo.train.tasks import get_task

B, T, D, V = 3, 8, 6, 11


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(keys[0], (B, T, D))
    table = jax.random.normal(keys[1], (V, D))
    bias = jax.random.normal(keys[2], (V,))
    targets = jax.random.randint(keys[3], (B, T), 0, V)
    weights = jnp.ones((B, T)).at[0, 5:].set(0.0).at[2, 1:].set(0.0)
    return hidden, table, bias, targets, weights


def _reference(hidden, table, bias, targets, weights, alpha):
    """-sum_k y~_k log softmax(logits)_k summed over weighted tokens (jax.nn)."""
    logits = hidden @ table.T + bias
    smoothed = (1 - alpha) * jax.nn.one_hot(targets, V) + alpha / V
    return -(weights * (smoothed * jax.nn.log_softmax(logits)).sum(-1)).sum()


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 8, 12])  # 3 and 12 pad T = 8
@pytest.mark.parametrize("alpha", [0.0, 0.1])
@pytest.mark.parametrize("kernels", [Kernels.PORTABLE, Kernels.CPU])
def test_loss_and_gradients_equal_the_loss_on_materialised_logits(num_chunks, alpha, kernels):
    args = _inputs()
    loss, metrics = chunked_output_loss(*args, alpha, num_chunks, kernels)
    np.testing.assert_allclose(loss, _reference(*args, alpha), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss_sum"], loss, rtol=0)

    def chunked(h, w, b):
        return chunked_output_loss(h, w, b, args[3], args[4], alpha, num_chunks, kernels)[0]

    got = jax.grad(chunked, argnums=(0, 1, 2))(*args[:3])
    want = jax.grad(_reference, argnums=(0, 1, 2))(*args, alpha)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # The gradient scales with the cotangent (backward = forward's gradients x g).
    scaled = jax.grad(lambda h: 3.0 * chunked(h, *args[1:3]))(args[0])
    np.testing.assert_allclose(scaled, 3.0 * got[0], rtol=1e-6)


def test_metric_sums_equal_a_float64_computation():
    hidden, table, bias, targets, weights = (np.asarray(a, np.float64) for a in _inputs(1))
    targets = targets.astype(np.int64)
    logits = hidden @ table.T + bias
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target_logit = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    _, metrics = chunked_output_loss(*_inputs(1), 0.1, 4)
    np.testing.assert_allclose(metrics["nll_sum"], (weights * (lse - target_logit)).sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(metrics["correct_sum"],
                               (weights * (logits.argmax(-1) == targets)).sum())
    assert float(metrics["tokens"]) == weights.sum()


def test_bad_shapes_and_chunk_counts_are_refused_with_the_values():
    hidden, table, bias, targets, weights = _inputs()
    with pytest.raises(ValueError, match="num_chunks must be >= 1, got 0"):
        chunked_output_loss(hidden, table, bias, targets, weights, 0.1, 0)
    with pytest.raises(ValueError, match=r"targets \(3, 7\).*disagree"):
        chunked_output_loss(hidden, table, bias, targets[:, :7], weights, 0.1, 1)
    with pytest.raises(ValueError, match=r"table \(11, 6\) must be \[V, D\] for bias \(10,\)"):
        chunked_output_loss(hidden, table, bias[:10], targets, weights, 0.1, 1)


def _model_and_batch(family, **model_kw):
    cfg = ModelConfig(vocab_size=V, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1,
                      num_decoder_layers=2, dropout_rate=0.1, max_length=16, **model_kw)
    task = get_task(family)
    model = task.build(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, V, (2, T)), jnp.int32).at[1, 6:].set(0)
    seg = (ids != 0).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids.shape)
    batch = dict(targets=ids[:, ::-1], targets_segmentation=seg[:, ::-1], targets_position=pos)
    if family == "encoder_decoder":
        batch.update(inputs=ids, inputs_segmentation=seg, inputs_position=pos)
    params = model.init(jax.random.key(0), **task.dummy_batch(2, T))["params"]
    return model, batch, nn.meta.unbox(params)


@pytest.mark.parametrize("family,model_kw,num_chunks", [
    ("encoder_decoder", {}, 4),
    ("encoder_decoder", {"output_bias": True, "kernels": "cpu"}, 4),
    ("decoder_only", {"norm_position": "pre"}, 3),  # T = 8 padded to 9
])
def test_a_train_step_with_the_chunked_loss_equals_the_step_on_logits(family, model_kw,
                                                                      num_chunks):
    model, batch, params = _model_and_batch(family, **model_kw)
    tx = optax.sgd(1.0)  # the update is the gradient (Adam would normalise away noise)
    outs = []
    for chunks in (0, num_chunks):
        step = jax.jit(make_train_step(model, family, 0.1, loss_chunks=chunks))
        outs.append(step(create_train_state(params, tx, 0), batch))
    (plain, plain_metrics), (chunked, chunked_metrics) = outs
    for name in ("loss", "loss_sum", "nll_sum", "correct_sum", "tokens", "grad_norm"):
        np.testing.assert_allclose(chunked_metrics[name], plain_metrics[name], rtol=1e-5,
                                   err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 chunked.params, plain.params)
    if model_kw.get("output_bias"):  # the bias is trained through the chunked path too
        assert float(jnp.abs(chunked.params["decoder"]["logits_bias"]).max()) > 0


def test_return_hidden_and_output_weights_give_the_logits():
    model, batch, params = _model_and_batch("decoder_only", output_bias=True)
    params["decoder"]["logits_bias"] = jnp.arange(V, dtype=jnp.float32) / V
    logits = model.apply({"params": params}, batch["targets"])
    hidden = model.apply({"params": params}, batch["targets"], return_hidden=True)
    table, bias = model.apply({"params": params}, method="output_weights")
    assert hidden.shape == (2, T, 8)
    np.testing.assert_allclose(hidden @ table.T + bias, logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,model_kw,chunks,message", [
    ("encoder_only", {"num_classes": 2}, 2, "needs a generating family"),
    ("encoder_decoder", {"tie_output": False}, 2, "needs tie_output=True"),
    ("encoder_decoder", {}, -1, "loss_chunks must be >= 0"),
])
def test_make_train_step_refuses_what_the_chunked_loss_cannot_do(family, model_kw, chunks,
                                                                  message):
    cfg = ModelConfig(vocab_size=V, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1,
                      num_decoder_layers=1, max_length=16, **model_kw)
    with pytest.raises(ValueError, match=message):
        make_train_step(get_task(family).build(cfg), family, 0.1, loss_chunks=chunks)


@pytest.mark.parametrize("overrides,message", [
    ({"model": {"tie_output": False}}, "train.loss_chunks=4 needs model.tie_output=True"),
    ({"family": "encoder_only"}, "needs a generating family"),
])
def test_the_config_check_refuses_loss_chunks_where_they_cannot_apply(overrides, message):
    config = tiny_config.get_config()
    config.train.loss_chunks = 4
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    with pytest.raises(ValueError, match=message):
        schema.check(config)

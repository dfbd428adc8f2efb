"""Schedules equal their formulas; the smoothed loss equals a hand computation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from transformer_zoo.train.losses import (
    label_smoothed_cross_entropy,
    smoothed_one_hot,
    smoothed_terms,
    smoothing_floor,
    summarize,
    token_metrics,
)
from transformer_zoo.train.schedules import make_schedule, rsqrt_warmup
from transformer_zoo.train.state import decay_mask, make_optimizer


@pytest.mark.parametrize("step", [1, 100, 3999, 4000, 4001, 10_000, 100_000])
def test_rsqrt_warmup_is_the_papers_formula(step):
    schedule = rsqrt_warmup(d_model=512, warmup_steps=4000)
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    # optax passes the update count (from 0); the paper counts steps from 1.
    np.testing.assert_allclose(float(schedule(step - 1)), expected, rtol=1e-6)


def test_rsqrt_warmup_peaks_at_warmup():
    schedule = rsqrt_warmup(d_model=512, warmup_steps=4000)
    values = np.array([float(schedule(s)) for s in range(0, 8000, 50)])
    assert abs(int(np.argmax(values)) * 50 - 3999) <= 50
    np.testing.assert_allclose(values.max(), 512**-0.5 * 4000**-0.5, rtol=1e-3)


def test_other_schedules():
    cosine = make_schedule("warmup_cosine", d_model=8, peak=1e-3, warmup_steps=100,
                           total_steps=2000, end_value=1e-4)
    np.testing.assert_allclose(float(cosine(50)), 5e-4, rtol=1e-5)
    np.testing.assert_allclose(float(cosine(100)), 1e-3, rtol=1e-5)
    np.testing.assert_allclose(float(cosine(2000)), 1e-4, rtol=1e-5)
    mid = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 0.5))
    np.testing.assert_allclose(float(cosine(1050)), mid, rtol=1e-5)
    isqrt = make_schedule("inverse_sqrt", d_model=8, peak=2.0, warmup_steps=100, total_steps=1)
    np.testing.assert_allclose(float(isqrt(399)), 2.0 * math.sqrt(100 / 400), rtol=1e-6)
    np.testing.assert_allclose(float(isqrt(49)), 2.0 * 50 / 100, rtol=1e-6)


def test_schedule_errors():
    with pytest.raises(ValueError, match="schedule='nope'"):
        make_schedule("nope", d_model=8, peak=1.0, warmup_steps=1, total_steps=2)
    with pytest.raises(ValueError, match="warmup_steps must be positive, got 0"):
        rsqrt_warmup(8, 0)


def test_label_smoothing_hand_computation():
    logits = np.array([[[2.0, 0.5, -1.0], [0.0, 0.0, 0.0]]])
    targets = np.array([[0, 2]])
    weights = np.array([[1.0, 0.0]])  # the second token is padding
    alpha = 0.1
    p = np.exp(logits[0, 0]) / np.exp(logits[0, 0]).sum()
    smoothed = np.array([0.9 + 0.1 / 3, 0.1 / 3, 0.1 / 3])
    expected = -(smoothed * np.log(p)).sum()
    loss, count = label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                               jnp.asarray(weights), alpha)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert float(count) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_hand_written_gradient_equals_autodiff_of_log_softmax(alpha):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 37)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, (3, 5)), jnp.float32)

    def reference(z):  # the textbook formula, differentiated by JAX
        logp = jax.nn.log_softmax(z, axis=-1)
        target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        loss = -((1 - alpha) * target_logp + alpha / 37 * logp.sum(-1))
        return (loss * weights).sum()

    ours = lambda z: label_smoothed_cross_entropy(z, targets, weights, alpha)[0]  # noqa: E731
    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(reference)(logits),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(logits), jax.grad(reference)(logits),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_shared_smoothed_terms_equal_float64_numpy(alpha):
    # The pieces both the usual loss and train/chunked_loss.py build on.
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 4, 11)) * 4
    targets = rng.integers(0, 11, (2, 4))
    terms = smoothed_terms(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), alpha)
    lse = np.log(np.exp(logits).sum(-1))
    logp = logits - lse[..., None]
    one_hot = np.eye(11)[targets]
    smoothed = (1 - alpha) * one_hot + alpha / 11
    np.testing.assert_allclose(terms.loss, -(smoothed * logp).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(terms.lse, lse, rtol=1e-6)
    np.testing.assert_allclose(terms.target_logit, (logits * one_hot).sum(-1), rtol=1e-6)
    np.testing.assert_allclose(terms.top, logits.max(-1), rtol=1e-6)
    np.testing.assert_allclose(terms.shifted_exp / terms.total[..., None], np.exp(logp),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(smoothed_one_hot(jnp.asarray(targets), 11, alpha), smoothed,
                               rtol=1e-6)
    assert smoothed_one_hot(jnp.asarray(targets), 11, alpha).shape == (2, 4, 11)


def test_smoothing_floor_is_the_minimum():
    alpha, K = 0.1, 7
    target = 3
    smoothed = np.full(K, alpha / K)
    smoothed[target] += 1 - alpha
    logits = jnp.log(jnp.asarray(smoothed))[None, None]
    loss, _ = label_smoothed_cross_entropy(logits, jnp.array([[target]]), jnp.ones((1, 1)), alpha)
    np.testing.assert_allclose(float(loss), smoothing_floor(alpha, K), rtol=1e-5)
    worse, _ = label_smoothed_cross_entropy(logits * 1.5, jnp.array([[target]]),
                                            jnp.ones((1, 1)), alpha)
    assert float(worse) > float(loss)


def test_summary_metrics():
    logits = jnp.array([[[3.0, 0.0], [0.0, 3.0], [3.0, 0.0]]])
    targets = jnp.array([[0, 0, 1]])
    sums = token_metrics(logits, targets, jnp.array([[1.0, 1.0, 0.0]]), 0.0)
    out = summarize(sums, 0.0, 2)
    assert out["accuracy"] == 0.5
    nll = (-math.log(math.exp(3) / (math.exp(3) + 1)) - math.log(1 / (math.exp(3) + 1))) / 2
    np.testing.assert_allclose(out["nll"], nll, rtol=1e-6)
    np.testing.assert_allclose(out["perplexity"], math.exp(nll), rtol=1e-6)


def test_accuracy_counts_the_argmax_tokens():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 16, 300)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 300, (4, 16)))
    targets = targets.at[:, ::3].set(jnp.argmax(logits, -1)[:, ::3])  # a third are hits
    weights = jnp.asarray(rng.random((4, 16)) < 0.8, jnp.float32)
    sums = jax.jit(token_metrics, static_argnums=3)(logits, targets, weights, 0.1)
    want = float(((jnp.argmax(logits, -1) == targets) * weights).sum())
    assert want > 10
    assert float(sums["correct_sum"]) == want
    # An exact tie for the maximum counts as correct for every tied class.
    tied = jnp.array([[[2.0, 5.0, 5.0]]])
    for target in (1, 2):
        out = token_metrics(tied, jnp.array([[target]]), jnp.ones((1, 1)), 0.0)
        assert float(out["correct_sum"]) == 1.0


def _optim(**kw):
    base = dict(name="adamw", b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1, schedule="constant",
                learning_rate=1e-3, warmup_steps=1, clip_norm=1.0, grad_accum_steps=1)
    base.update(kw)
    return ConfigDict(base)


def test_adamw_decays_weights_only():
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,))},
              "norm": {"scale": jnp.ones((2,))}}
    mask = decay_mask(params)
    assert mask == {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False}}
    tx, _ = make_optimizer(_optim(), d_model=2, total_steps=10)
    zero = {"dense": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros((2,))},
            "norm": {"scale": jnp.zeros((2,))}}
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(jnp.abs(updates["dense"]["kernel"]).max()) > 0  # decay acts on zero grads
    assert float(jnp.abs(updates["dense"]["bias"]).max()) == 0
    assert float(jnp.abs(updates["norm"]["scale"]).max()) == 0


def test_adam_refuses_a_weight_decay_it_would_not_apply():
    with pytest.raises(ValueError, match=r"optim.weight_decay=0.1 is applied by "
                                         r"optim.name='adamw' only"):
        make_optimizer(_optim(name="adam"), d_model=2, total_steps=10)
    make_optimizer(_optim(name="adam", weight_decay=0.0), d_model=2, total_steps=10)


def test_gradient_accumulation_averages_micro_batches():
    params = {"w": jnp.array([1.0, 2.0])}
    adam = dict(name="adam", weight_decay=0.0, clip_norm=0.0)
    tx, _ = make_optimizer(_optim(**adam, grad_accum_steps=2), 2, 10)
    plain, _ = make_optimizer(_optim(**adam), 2, 10)
    state = tx.init(params)
    g1, g2 = {"w": jnp.array([1.0, -3.0])}, {"w": jnp.array([3.0, 1.0])}
    u1, state = tx.update(g1, state, params)
    assert float(jnp.abs(u1["w"]).max()) == 0.0  # no update on the first micro-batch
    u2, state = tx.update(g2, state, params)
    expected, _ = plain.update({"w": (g1["w"] + g2["w"]) / 2}, plain.init(params), params)
    np.testing.assert_allclose(u2["w"], expected["w"], rtol=1e-6)

"""models/gradient_barrier.py: an identity whose gradient is unchanged, with
the conditional that stops XLA:CPU recomputing pre-norm residual gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import init, normal, tiny_config

import models
from models import gradient_barrier
from models.gradient_barrier import stored_gradient

pytestmark = pytest.mark.usefixtures("fast_compilation")


def _loss(x):
    return jnp.sum(jnp.sin(stored_gradient(x)) * x)


def test_forward_is_identity_and_gradient_is_unchanged():
    x = normal(0, (3, 5))
    np.testing.assert_array_equal(stored_gradient(x), x)
    expected = jnp.cos(x) * x + jnp.sin(x)
    np.testing.assert_allclose(jax.jit(jax.grad(_loss))(x), expected, rtol=1e-6, atol=1e-6)


def test_backward_has_the_conditional_on_cpu_only(monkeypatch):
    x = normal(0, (3, 5))
    assert "cond" in str(jax.make_jaxpr(jax.grad(_loss))(x))
    monkeypatch.setattr(gradient_barrier, "enabled", lambda: False)
    assert "cond" not in str(jax.make_jaxpr(jax.grad(_loss))(x))


def test_nan_gradients_stay_nan():
    g = jax.vjp(stored_gradient, jnp.zeros(4))[1](jnp.array([jnp.nan, 1.0, -0.0, 2.0]))[0]
    assert np.isnan(g[0]) and list(np.asarray(g[1:])) == [1.0, 0.0, 2.0]


def test_pre_norm_model_gradients_equal_without_the_barrier(monkeypatch):
    """The barrier changes which values XLA stores, not the gradient."""
    cfg = tiny_config(norm_position="pre", num_decoder_layers=2)
    model = models.DecoderOnly(cfg)
    ids = jnp.array([[5, 6, 7, 8, 9, 3], [4, 3, 2, 9, 8, 7]])
    params = init(model, ids)

    def grads():
        loss = lambda p: jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, ids))[..., 3])  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    with_barrier = grads()
    monkeypatch.setattr(gradient_barrier, "enabled", lambda: False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 with_barrier, grads())

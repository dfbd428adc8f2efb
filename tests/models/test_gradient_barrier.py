"""models/gradient_barrier.py: an identity whose gradient is unchanged, with
the conditional that stops XLA:CPU recomputing pre-norm residual gradients."""

import flax.linen as nn
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


# ---------------------------------------------------------------- stored_transpose


def test_stored_transpose_is_the_transpose_behind_a_conditional(monkeypatch):
    x = normal(1, (4, 6))
    np.testing.assert_array_equal(jax.jit(gradient_barrier.stored_transpose)(x), x.T)
    jaxpr = lambda: str(jax.make_jaxpr(lambda v: gradient_barrier.stored_transpose(v))(x))  # noqa: E731
    assert "cond" in jaxpr()
    monkeypatch.setattr(gradient_barrier, "enabled", lambda: False)
    assert "cond" not in jaxpr()
    with pytest.raises(ValueError, match=r"\[M, K\].*\(2, 3, 4\)"):
        gradient_barrier.stored_transpose(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("in_dims,features", [(1, 7), (1, (2, 3)), (2, 5)])
def test_projection_gradients_equal_autodiff_of_tensordot(in_dims, features):
    from models.projection import Projection

    x = normal(2, (2, 3, 4) if in_dims == 1 else (2, 3, 2, 2))
    layer = Projection(features=features, kernel_axes=("a",) * (in_dims + np.ndim(features)),
                       in_dims=in_dims)
    params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    cot = normal(3, layer.apply({"params": params}, x).shape)

    def ours(p, x):
        return jnp.sum(layer.apply({"params": p}, x) * cot)

    def reference(p, x):
        return jnp.sum(jnp.tensordot(x, p["kernel"], axes=in_dims) * cot)

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(params, x)
    want = jax.grad(reference, argnums=(0, 1))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_weight_gradient_dots_contract_the_last_dim_of_their_left_operand(monkeypatch):
    """The point of stored_transpose: in a model's backward no dot contracts
    dimension 0 of its left operand (XLA:CPU runs those in Eigen, not YNNPACK);
    without the conditionals the kernel and table gradients are such dots."""
    model = models.EncoderDecoder(tiny_config(dropout_rate=0.0))
    ids = jnp.tile(jnp.arange(3, 19)[None], (4, 1))
    params = init(model, ids, ids)

    def transposed_dots():
        jax.clear_caches()
        loss = lambda p: jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, ids, ids))[..., 3])  # noqa: E731
        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
        assert hlo.count(" dot(") + hlo.count("__ynn_fusion") > 10
        return hlo.count("lhs_contracting_dims={0}")

    assert transposed_dots() == 0
    monkeypatch.setattr(gradient_barrier, "enabled", lambda: False)
    assert transposed_dots() >= 10

"""The counter-hash dropout: exact keep probability, unbiased, independent masks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_zoo.models.dropout import (
    Dropout,
    dropout,
    keep_mask,
    keep_probability,
    keep_threshold,
)

N = 1 << 22  # 4M draws: the keep fraction's standard deviation is 1.5e-4 at rate 0.1


@pytest.mark.parametrize("rate", [0.1, 0.25, 0.5, 0.9])
def test_keep_fraction_is_the_quantised_keep_probability(rate):
    keep = keep_probability(rate)
    assert abs(keep - (1 - rate)) <= 2**-17  # 16-bit quantisation: 0.1 -> 0.899994
    frac = float(keep_mask(jax.random.key(0), rate, (N,)).mean())
    assert abs(frac - keep) < 5 * np.sqrt(keep * (1 - keep) / N)


def test_dropout_is_unbiased_and_scales_by_the_exact_keep():
    x = jnp.ones((N,), jnp.float32)
    y = np.asarray(dropout(x, 0.1, jax.random.key(1)))
    assert set(np.unique(y)) == {0.0, np.float32(1 / keep_probability(0.1))}
    np.testing.assert_allclose(keep_probability(0.1) / keep_probability(0.1), 1.0)
    assert abs(y.mean() - 1.0) < 5 * np.sqrt(0.1 / 0.9 / N)


def test_masks_are_independent_across_keys_halves_and_neighbours():
    rate, shape = 0.5, (N,)
    base = jax.random.key(7)
    layer_a, layer_b = jax.random.fold_in(base, 0), jax.random.fold_in(base, 1)  # two layers
    step_2 = jax.random.fold_in(jax.random.key(8), 2)  # another step
    a, b, c = (np.asarray(keep_mask(k, rate, shape)) for k in (layer_a, layer_b, step_2))
    tol = 5 * np.sqrt(0.25 * 0.75 / N)  # P(both kept) = 0.25 if independent
    for x, y in ((a, b), (a, c), (b, c), (a[: N // 2], a[N // 2:]), (a[:-1], a[1:])):
        assert abs(float((x & y).mean()) - 0.25) < tol
    assert a.any() and not a.all() and (a != b).any()


def test_sixteen_bit_draws_are_uniform():
    # Through the threshold: the keep fraction at 16 rates matches each quantised keep.
    key = jax.random.key(3)
    for rate in np.linspace(0.05, 0.95, 16):
        frac = float(keep_mask(key, float(rate), (1 << 18,)).mean())
        keep = keep_probability(float(rate))
        assert abs(frac - keep) < 5 * np.sqrt(keep * (1 - keep) / (1 << 18)), rate


def test_masks_are_deterministic_and_shape_only_through_the_index():
    key = jax.random.key(5)
    m1 = keep_mask(key, 0.3, (6, 7, 9))
    np.testing.assert_array_equal(m1, keep_mask(key, 0.3, (6, 7, 9)))
    np.testing.assert_array_equal(m1, jax.jit(keep_mask, static_argnums=(1, 2))(key, 0.3,
                                                                              (6, 7, 9)))
    raw = jax.random.key_data(key)  # raw uint32 key data works too
    np.testing.assert_array_equal(m1, keep_mask(raw, 0.3, (6, 7, 9)))


def test_module_matches_nn_dropout_interface():
    x = jnp.ones((4, 64))
    layer = Dropout(0.5)
    out = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
    assert 0 < float((out == 0).mean()) < 1
    np.testing.assert_array_equal(layer.apply({}, x, deterministic=True), x)
    np.testing.assert_array_equal(Dropout(1.0).apply({}, x, deterministic=False), 0 * x)
    assert isinstance(layer, nn.Module)


def test_gradient_is_the_scaled_mask():
    key = jax.random.key(9)
    x = jnp.linspace(-1, 1, 4096)
    grad = jax.grad(lambda x: dropout(x, 0.2, key).sum())(x)
    expected = keep_mask(key, 0.2, x.shape) / keep_probability(0.2)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_bad_rates_are_value_errors(rate):
    with pytest.raises(ValueError, match="dropout rate must be in"):
        keep_threshold(rate)

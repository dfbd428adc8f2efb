"""Sinusoidal, learned, RoPE and ALiBi positions against the papers' formulas."""

import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import init, normal

from transformer_zoo.models import LearnedPositionalEmbedding, alibi_bias, alibi_slopes, apply_rope
from transformer_zoo.models import sinusoidal_encoding as sinusoidal

pytestmark = pytest.mark.usefixtures("fast_compilation")

D = 16


def paper_frequencies(d_model):
    """omega_i = 1 / 10000^(2i / d_model), float64."""
    return 1.0 / 10000.0 ** (2.0 * np.arange(d_model // 2) / d_model)


def test_sinusoidal_matches_paper_formula_in_float64():
    pos = np.arange(50)
    got = np.asarray(sinusoidal(jnp.asarray(pos)[None], D))[0]
    angles = pos[:, None] * paper_frequencies(D)[None]
    assert got.shape == (50, D) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 0::2], np.sin(angles), atol=2e-5)
    np.testing.assert_allclose(got[:, 1::2], np.cos(angles), atol=2e-5)
    np.testing.assert_array_equal(got[0, 0::2], 0.0)
    np.testing.assert_array_equal(got[0, 1::2], 1.0)


@pytest.mark.parametrize("offset", [1, 5, 17])
def test_sinusoidal_shift_is_a_rotation_of_each_pair(offset):
    """PE(pos + k) = R_k PE(pos) in each (sin, cos) pair, R_k depending only on k."""
    pos = np.arange(20)
    pe = np.asarray(sinusoidal(jnp.asarray(pos)[None], D))[0].astype(np.float64)
    shifted = np.asarray(sinusoidal(jnp.asarray(pos + offset)[None], D))[0].astype(np.float64)
    for i, w in enumerate(paper_frequencies(D)):
        c, s = np.cos(offset * w), np.sin(offset * w)
        rot = np.array([[c, s], [-s, c]])  # (sin a, cos a) -> (sin(a + b), cos(a + b))
        pair = pe[:, 2 * i : 2 * i + 2]
        np.testing.assert_allclose(pair @ rot.T, shifted[:, 2 * i : 2 * i + 2], atol=5e-5)


def test_sinusoidal_rejects_odd_width():
    with pytest.raises(ValueError, match="even d_model, got 15"):
        sinusoidal(jnp.zeros((1, 3), jnp.int32), 15)


def test_learned_table_lookup_and_length_error():
    layer = LearnedPositionalEmbedding(max_length=8, features=D)
    pos = jnp.array([[0, 1, 2, 0, 1, 7]])
    params = init(layer, pos)
    table = np.asarray(params["pos_embedding"])
    assert table.shape == (8, D)
    np.testing.assert_array_equal(np.asarray(layer.apply({"params": params}, pos))[0],
                                  table[np.asarray(pos)[0]])
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds .*max_length=8"):
        layer.apply({"params": params}, jnp.zeros((1, 9), jnp.int32))


def rope_reference(x, pos, base=10000.0):
    """Float64 half-split RoPE: rotates (x_i, x_{i+H/2}) by pos * base^(-2i/H)."""
    x = np.asarray(x, np.float64)
    H = x.shape[-1]
    theta = base ** (-np.arange(0, H, 2) / H)
    ang = np.asarray(pos, np.float64)[..., None, None] * theta
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def test_rope_matches_float64_reference_and_keeps_norms():
    x = normal(0, (2, 6, 4, 8))
    pos = jnp.array([[0, 1, 2, 3, 4, 5], [7, 3, 0, 11, 2, 9]])
    got = np.asarray(apply_rope(x, pos))
    np.testing.assert_allclose(got, rope_reference(x, pos), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_allclose(got[0, 0], np.asarray(x)[0, 0], rtol=1e-6)  # position 0


def test_rope_score_depends_only_on_offset():
    q = normal(1, (1, 1, 1, 8))
    k = normal(2, (1, 1, 1, 8))

    def score(m, n):
        qm = apply_rope(q, jnp.array([[m]]))
        kn = apply_rope(k, jnp.array([[n]]))
        return float(jnp.sum(qm * kn))

    for delta in (0, 1, 3):
        ref = score(delta, 0)
        for n in (1, 5, 20):
            np.testing.assert_allclose(score(n + delta, n), ref, rtol=1e-4, atol=1e-5)
    assert abs(score(3, 0) - score(1, 0)) > 1e-3  # and it does depend on the offset


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        apply_rope(jnp.zeros((1, 2, 1, 7)), jnp.zeros((1, 2), jnp.int32))


def test_alibi_slopes_power_of_two_heads():
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-k for k in range(1, 9)], rtol=1e-7)
    np.testing.assert_allclose(alibi_slopes(4), [2.0**-k for k in (2, 4, 6, 8)], rtol=1e-7)


def test_alibi_slopes_other_head_counts_follow_the_paper_recipe():
    # Press et al.: slopes of the closest power of two (4, resp. 8), then every
    # other slope of twice as many heads (8, resp. 16) until n heads.
    six = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    np.testing.assert_allclose(alibi_slopes(6), six, rtol=1e-7)
    twelve = [2.0**-k for k in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    np.testing.assert_allclose(alibi_slopes(12), twelve, rtol=1e-6)
    with pytest.raises(ValueError, match="num_heads must be positive, got 0"):
        alibi_slopes(0)


def test_alibi_bias_is_minus_slope_times_distance():
    slopes = jnp.asarray(alibi_slopes(4))
    pos = jnp.array([[0, 1, 2, 0, 1]])
    got = np.asarray(alibi_bias(slopes, pos, pos))
    p = np.asarray(pos)[0]
    want = -np.asarray(slopes)[:, None, None] * np.abs(p[:, None] - p[None])
    assert got.shape == (1, 4, 5, 5)
    np.testing.assert_allclose(got[0], want, rtol=1e-7)

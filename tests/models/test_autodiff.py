"""Forward-mode and higher-order autodiff through the public modules (default kernels).

Every case is a function of (params, inputs): a module's output, or a family's
scalar loss of its logits. K random directions d_i in (params, inputs) space
define g(alpha) = f(primals + sum_i alpha_i d_i), so that jacfwd, jacrev and
hessian stay [*out, K] and [K, K] however many parameters a model has.

References are independent of the transform under test: central finite
differences of the same module run in float64, and the other modes (vjp,
jacrev, grad) of the float32 module. The modules compute norms, softmax,
positions and logits in float32 whatever their dtype (DESIGN.md), which would
cap finite differences near 1e-4, so the float64 runs also read `jnp.float32`
as float64 inside models/ (`float64_models`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import init, normal, random_ids, tiny_config

from transformer_zoo import models

pytestmark = pytest.mark.usefixtures("fast_compilation")

B, T, S, D, V = 2, 4, 3, 8, 16
K = 3  # random directions
STEP = 1e-5  # central-difference step in float64: truncation ~STEP^2, rounding ~1e-16 / STEP
RTOL64 = 1e-6  # float64 transform vs float64 finite differences
RTOL32 = 1e-4  # float32 transform vs float64 reference or another float32 mode
SMALL = dict(vocab_size=V, d_model=D, num_heads=2, d_ff=16, max_length=8)


def _jit(fn, **kwargs):
    """jax.jit; on CPU with the legacy emitters, which compile these many small
    second-order programs in half the time (the file's runtime is compilation)."""
    options = {"xla_cpu_use_fusion_emitters": False} if jax.default_backend() == "cpu" else {}
    return jax.jit(fn, compiler_options=options, **kwargs)


def _models_modules():
    return [m for name, m in list(sys.modules.items()) if name.startswith("transformer_zoo.models")]


@pytest.fixture(autouse=True)
def _x64_stays_off():
    assert not jax.config.read("jax_enable_x64")
    yield
    assert not jax.config.read("jax_enable_x64"), "a test left jax_enable_x64 switched on"
    assert not any(isinstance(getattr(m, "jnp", None), _Float64Numpy)
                   for m in _models_modules()), "float64_models was not undone"


class _Float64Numpy:
    """jax.numpy, except that `float32` reads as float64."""

    def __getattr__(self, name):
        return jnp.float64 if name == "float32" else getattr(jnp, name)


@contextlib.contextmanager
def float64_models():
    """x64 on, and models/ computing in float64 wherever it names float32; both undone after."""
    with jax.enable_x64(True), pytest.MonkeyPatch.context() as patch:
        for module in _models_modules():
            if getattr(module, "jnp", None) is jnp:
                patch.setattr(module, "jnp", _Float64Numpy())
        yield


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """forward(dtype) -> f(params, x); float32 params and float inputs x (None: ids only)."""

    forward: Callable[[Any], Callable[[Any, Any], Any]]
    params: Any
    x: Any


def _module_case(make, call, x) -> Case:
    """A flax module made by make(dtype), run as call(module, x)."""
    params = _jit(lambda x: init(make(jnp.float32), x, method=call))(x)

    def forward(dtype):
        module = make(dtype)
        return lambda p, x: module.apply({"params": p}, x, method=call)

    return Case(forward, params, x)


def _function_case(fn, x) -> Case:
    """A parameter-free function of float inputs (its dtype follows theirs)."""
    return Case(lambda dtype: lambda p, x: fn(x), {}, x)


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _cfg(dtype, **overrides):
    return tiny_config(**SMALL, dtype=dtype, param_dtype=dtype, **overrides)


def _padded_ids(seed, length):
    """[B, length] ids whose second row ends in one PAD."""
    return random_ids(seed, (B, length), vocab=V).at[1, -1].set(0)


def _segments(length):
    return jnp.ones((B, length), jnp.int32).at[1, -1].set(0)


def _mha_case(position_encoding):
    def make(dtype):
        return models.MultiHeadAttention(num_heads=2, use_bias=True, dtype=dtype,
                                         param_dtype=dtype, position_encoding=position_encoding)

    mask = models.causal_mask(T)
    return _module_case(make, lambda m, x: m(x, mask=mask), normal(1, (B, T, D)))


def _encoder_block_case():
    mask = models.make_attention_mask(_segments(T))
    return _module_case(lambda dtype: models.EncoderBlock(_cfg(dtype)),
                        lambda m, x: m(x, mask), normal(2, (B, T, D)))


def _decoder_block_case():
    seg_t, seg_s = _segments(T), _segments(S)
    pos_t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    self_mask = models.make_attention_mask(seg_t, causal=True)
    cross_mask = models.AttentionMask(q_positions=pos_t, kv_positions=jnp.zeros_like(seg_s),
                                      q_segment_ids=seg_t, kv_segment_ids=seg_s)

    def call(m, x):
        h, encoded = x
        return m(h, self_mask, encoded=encoded, cross_mask=cross_mask)

    return _module_case(lambda dtype: models.DecoderBlock(_cfg(dtype)), call,
                        (normal(3, (B, T, D)), normal(4, (B, S, D))))


def _encoder_decoder_case():
    inputs, targets = _padded_ids(5, S), random_ids(6, (B, T), vocab=V)
    return _module_case(lambda dtype: models.EncoderDecoder(_cfg(dtype)),
                        lambda m, _: _xent(m(inputs, targets), targets), None)


def _decoder_only_case(**overrides):
    targets = _padded_ids(7, T)
    return _module_case(lambda dtype: models.DecoderOnly(_cfg(dtype, **overrides)),
                        lambda m, _: _xent(m(targets), targets), None)


def _encoder_only_case():
    inputs = _padded_ids(8, T)
    labels = jnp.array([0, 2], jnp.int32)

    def call(m, _):
        out = m(inputs)
        return _xent(out["token_logits"], inputs) + _xent(out["class_logits"], labels)

    return _module_case(lambda dtype: models.EncoderOnly(_cfg(dtype, num_classes=3)), call, None)


def _layer_norm_case():
    def make(dtype):
        return models.LayerNorm(dtype=dtype, param_dtype=dtype)

    case = _module_case(make, lambda m, x: m(x), normal(9, (B, T, D)))
    # Non-trivial scale and bias, so that their tangents and curvature matter.
    params = jax.tree.map(lambda p: p + normal(10, p.shape, 0.5), case.params)
    return dataclasses.replace(case, params=params)


def _attention_case():
    mask = models.causal_mask(T)
    qkv = (normal(11, (B, T, 2, 4)), normal(12, (B, T, 1, 4)), normal(13, (B, T, 1, 4)))
    return _function_case(lambda x: models.dot_product_attention(*x, mask=mask), qkv)


def _rope_case():
    positions = jnp.arange(T, dtype=jnp.int32)[None] + 3
    return _function_case(lambda x: models.apply_rope(x, positions), normal(14, (B, T, 2, 4)))


def _sinusoidal_case():
    positions = jnp.asarray(np.linspace(0.0, 5.0, B * T).reshape(B, T), jnp.float32)
    return _function_case(lambda pos: models.sinusoidal_encoding(pos, D), positions)


# Plain JAX whatever the CPU layer does: these validate the harness on their own.
PLAIN = {
    "layer_norm": _layer_norm_case,
    "dot_product_attention": _attention_case,
    "apply_rope": _rope_case,
    "sinusoidal_encoding": _sinusoidal_case,
}
MODULES = {
    "mha_causal": functools.partial(_mha_case, "none"),
    "mha_rope": functools.partial(_mha_case, "rope"),
    "encoder_block": _encoder_block_case,
    "decoder_block_cross": _decoder_block_case,
}
FAMILIES = {
    "encoder_decoder": _encoder_decoder_case,
    "decoder_only": _decoder_only_case,
    "encoder_only": _encoder_only_case,
}
CASES = {**PLAIN, **MODULES, **FAMILIES}
ALL = pytest.mark.parametrize("name", list(CASES))


# ----------------------------------------------------------------------------- harness


def _to64(tree):
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def _random_like(tree, seed, scale=0.3):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([normal(seed + i, leaf.shape, scale) for i, leaf in enumerate(leaves)])


def _along(primals, directions, alpha):
    return jax.tree.map(lambda p, *ds: p + sum(a * d for a, d in zip(alpha, ds, strict=True)),
                        primals, *directions)


def _scalar(y):
    """A smooth scalar of a module's output (a family's loss is one already)."""
    if y.ndim == 0:
        return y
    weights = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
    return jnp.sum(jnp.tanh(y) * weights)


def _dot(a, b):
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def assert_rel(actual, expected, rtol, what):
    """Elementwise, with atol = rtol * max|expected| over the whole tree, which must not be 0."""
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves), what
    expected_leaves = [np.asarray(e, np.float64) for e in expected_leaves]
    scale = max(np.abs(e).max() for e in expected_leaves)
    assert scale > 1e-6, f"{what}: the reference is zero, the check would be vacuous"
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        a = np.asarray(a, np.float64)
        assert a.shape == e.shape, (what, a.shape, e.shape)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=what)


class _Reference(NamedTuple):
    """The float64 side of a Problem; trace and call its functions inside float64_models."""

    primals: Any
    directions: list
    g: Callable  # alpha -> g(alpha), jitted
    grad_s: Callable  # alpha -> grad s(alpha), jitted (reverse mode)


class Problem:
    """One case: f(primals) in float32 (the default), K directions, float64 references.

    g(alpha) = f(primals + sum_i alpha_i d_i) and s(alpha) = scalar(g(alpha)).
    """

    def __init__(self, case: Case):
        self.f = case.forward(jnp.float32)
        self._forward64 = case.forward(jnp.float64)
        self.primals = (case.params, case.x)
        self.directions = [_random_like(self.primals, 100 * (i + 1)) for i in range(K)]
        self.cotangent = normal(7, jax.eval_shape(self.f, *self.primals).shape)

    def f_tree(self, primals):
        return self.f(*primals)

    def g(self, alpha):
        return self.f_tree(_along(self.primals, self.directions, alpha))

    def s(self, alpha):
        return _scalar(self.g(alpha))

    @functools.cached_property
    def jvp(self):
        """(f, J d_0) in float32."""
        return _jit(jax.jvp, static_argnums=0)(self.f_tree, (self.primals,),
                                               (self.directions[0],))

    @functools.cached_property
    def pullback(self):
        """J^T cotangent in float32 (reverse mode)."""
        return _jit(lambda pr, c: jax.vjp(self.f_tree, pr)[1](c)[0])(self.primals,
                                                                      self.cotangent)

    @functools.cached_property
    def _reference(self) -> _Reference:
        with float64_models():
            primals, directions = _to64(self.primals), _to64(self.directions)

            def g(alpha):
                return self._forward64(*_along(primals, directions, alpha))

            return _Reference(primals, directions, _jit(g), _jit(jax.grad(lambda a: _scalar(g(a)))))

    def _central(self, fn):
        """[K, ...] float64 central differences of fn along each alpha axis at 0."""
        with float64_models():
            cols = [(np.asarray(fn(STEP * e)) - np.asarray(fn(-STEP * e))) / (2 * STEP)
                    for e in np.eye(K)]
            assert all(col.dtype == np.float64 for col in cols), "the reference is not float64"
            return np.stack(cols)

    @functools.cached_property
    def fd_jacobian(self):
        """d g / d alpha_i: [K, *out]."""
        return self._central(self._reference.g)

    @functools.cached_property
    def fd_gradient(self):
        """d s / d alpha_i: [K]."""
        g = self._reference.g
        return self._central(lambda alpha: _scalar(g(alpha)))

    @functools.cached_property
    def fd_hessian(self):
        """d (grad s) / d alpha_i, the float64 reverse-mode gradient differenced: [K, K]."""
        return self._central(self._reference.grad_s)

    @functools.cached_property
    def grad64(self):
        """grad s at 0 in float64 (reverse mode): [K]."""
        with float64_models():
            return np.asarray(self._reference.grad_s(np.zeros(K)))

    def in64(self, transform):
        """transform(f64, primals64, directions64) as numpy, run in float64_models."""
        ref = self._reference
        with float64_models():
            out = _jit(lambda: transform(lambda pr: self._forward64(*pr), ref.primals,
                                         ref.directions))()
            return jax.tree.map(lambda a: np.asarray(a, np.float64), out)


@functools.cache
def problem(name: str) -> Problem:
    return Problem(CASES[name]())


# ----------------------------------------------------------------------------- forward mode


@ALL
def test_jvp_matches_float64_central_differences_and_vjp(name):
    p = problem(name)
    y, jvp = p.jvp
    assert_rel(y, _jit(p.f)(*p.primals), RTOL32, "jvp primal output")
    assert_rel(jvp, p.fd_jacobian[0], RTOL32, "float32 jvp vs float64 finite differences")
    jvp64 = p.in64(lambda f, x, d: jax.jvp(f, (x,), (d[0],))[1])
    assert_rel(jvp64, p.fd_jacobian[0], RTOL64, "float64 jvp vs float64 finite differences")
    # <J d, c> == <d, J^T c>, J^T c from reverse mode.
    assert_rel(_dot(jvp, p.cotangent), _dot(p.directions[0], p.pullback), RTOL32,
               "jvp . cotangent vs vjp contraction")


@ALL
def test_linearize_matches_jvp_and_finite_differences_and_transposes_to_vjp(name):
    p = problem(name)
    y, linear = jax.linearize(jax.jit(p.f_tree), p.primals)
    f_jvp = _jit(linear)
    assert_rel(y, p.jvp[0], RTOL32, "linearize primal output")
    assert_rel(f_jvp(p.directions[0]), p.jvp[1], RTOL32, "linearize vs jvp")
    for i in range(K):
        assert_rel(f_jvp(p.directions[i]), p.fd_jacobian[i], RTOL32,
                   f"linearized jvp along direction {i} vs float64 finite differences")
    combined = jax.tree.map(lambda a, b: 2.0 * a - b, p.directions[1], p.directions[2])
    assert_rel(f_jvp(combined), 2.0 * p.fd_jacobian[1] - p.fd_jacobian[2], RTOL32,
               "linearized jvp of a combined tangent")
    (transposed,) = _jit(jax.linear_transpose(linear, p.primals))(p.cotangent)
    assert_rel(transposed, p.pullback, RTOL32, "transposed linearization vs vjp")


@ALL
def test_jacfwd_along_directions_equals_jacrev_and_finite_differences(name):
    p = problem(name)
    alpha = jnp.zeros(K)
    fwd = _jit(jax.jacfwd(p.g))(alpha)  # [*out, K]
    assert_rel(fwd, _jit(jax.jacrev(p.g))(alpha), RTOL32, "jacfwd vs jacrev")
    assert_rel(np.moveaxis(np.asarray(fwd), -1, 0), p.fd_jacobian, RTOL32,
               "jacfwd vs float64 finite differences")


@pytest.mark.parametrize("name", [*PLAIN, *MODULES])
def test_jacfwd_wrt_inputs_equals_jacrev(name):
    p = problem(name)
    params, x = p.primals
    fwd = _jit(jax.jacfwd(lambda x: p.f(params, x)))(x)
    assert_rel(fwd, _jit(jax.jacrev(lambda x: p.f(params, x)))(x), RTOL32,
               "jacfwd vs jacrev wrt the inputs")


# ----------------------------------------------------------------------------- second order


@ALL
def test_hessian_is_symmetric_and_equals_jvp_of_grad_and_finite_differences(name):
    p = problem(name)
    alpha = jnp.zeros(K)
    hess = np.asarray(_jit(jax.hessian(p.s))(alpha), np.float64)  # [K, K]
    assert_rel(hess, hess.T, RTOL32, "hessian symmetry")
    hvp = _jit(lambda v: jax.jvp(jax.grad(p.s), (alpha,), (v,))[1])
    for i, e in enumerate(np.eye(K, dtype=np.float32)):
        assert_rel(hess @ e, hvp(e), RTOL32, f"hessian times e_{i} vs jvp of grad")
    assert_rel(hess, p.fd_hessian.T, RTOL32,
               "hessian vs float64 central differences of the float64 gradient")


# ----------------------------------------------------------------------------- reverse mode
# The references' own check; reverse mode also works through the CPU layer's custom_vjp.


@ALL
def test_grad_matches_float64_central_differences(name):
    p = problem(name)
    grad = _jit(jax.grad(lambda pr: _scalar(p.f_tree(pr))))(p.primals)
    along = np.array([_dot(grad, d) for d in p.directions])
    assert_rel(along, p.fd_gradient, RTOL32, "float32 grad vs float64 finite differences")
    assert_rel(p.grad64, p.fd_gradient, RTOL64, "float64 grad vs float64 finite differences")


# ----------------------------------------------------------------------------- vmap


def _member(tree, i):
    return jax.tree.map(lambda leaf: leaf[i], tree)


def test_vmap_over_parameter_perturbations_through_decoder_only():
    """The loss, its gradient and its jvp at three perturbed parameter sets, batched."""
    p = problem("decoder_only")
    direction, tangent = p.directions[0][0], p.directions[1][0]
    scales = jnp.array([0.0, 0.5, -1.0], jnp.float32)
    batch = jax.tree.map(lambda w, d: w + scales.reshape(-1, *[1] * w.ndim) * d,
                         p.primals[0], direction)

    def derivatives(params):
        value, grad = jax.value_and_grad(p.f)(params, None)
        return value, grad, jax.jvp(lambda w: p.f(w, None), (params,), (tangent,))[1]

    batched = _jit(jax.vmap(derivatives))(batch)
    single = _jit(derivatives)
    for i in range(len(scales)):
        for what, got, want in zip(("loss", "grad", "jvp"), _member(batched, i),
                                   single(_member(batch, i)), strict=True):
            assert_rel(got, want, 1e-5, f"vmapped {what} at perturbation {i}")
    assert abs(batched[0][2] - batched[0][0]) > 1e-3, "the perturbations do not change the loss"

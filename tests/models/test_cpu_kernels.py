"""The XLA:CPU layer (models/cpu_kernels.py, kernels=Kernels.CPU).

Its pieces against float64 / autodiff references, the whole layer off vs on
for every family (same values: it changes speed only), the decode weights
(built from the parameters, never a module-created collection), and the
platform choice (exported programs for GPU/TPU carry no CPU conditional).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from zoo_testlib import assert_close, init, key, normal, random_ids, tiny_config

from transformer_zoo import models
from transformer_zoo.models import FeedForward, Kernels, MultiHeadAttention, cpu_kernels
from transformer_zoo.models import generate as gen
from transformer_zoo.models.projection import Projection

DW = cpu_kernels.DECODE_WEIGHTS
CPU, PORTABLE = Kernels.CPU, Kernels.PORTABLE

pytestmark = pytest.mark.usefixtures("fast_compilation")


def _compiled_cpu_hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


# ------------------------------------------------------------------ training pieces


def _loss(x):
    return jnp.sum(jnp.sin(cpu_kernels.stored_gradient(x)) * x)


def test_stored_gradient_is_identity_with_autodiffs_gradient_behind_a_conditional():
    x = normal(0, (3, 5))
    np.testing.assert_array_equal(cpu_kernels.stored_gradient(x), x)
    expected = jnp.cos(x) * x + jnp.sin(x)
    np.testing.assert_allclose(jax.jit(jax.grad(_loss))(x), expected, rtol=1e-6, atol=1e-6)
    assert "conditional(" in _compiled_cpu_hlo(jax.grad(_loss), x)


def test_stored_gradient_keeps_nan_gradients():
    g = jax.vjp(cpu_kernels.stored_gradient, jnp.zeros(4))[1](jnp.array([jnp.nan, 1.0, -0.0, 2.]))
    assert np.isnan(g[0][0]) and list(np.asarray(g[0][1:])) == [1.0, 0.0, 2.0]


def test_stored_transpose_is_the_transpose_behind_a_conditional():
    x = normal(1, (4, 6))
    np.testing.assert_array_equal(jax.jit(cpu_kernels.stored_transpose)(x), x.T)
    assert "conditional(" in _compiled_cpu_hlo(cpu_kernels.stored_transpose, x)
    with pytest.raises(ValueError, match=r"\[M, K\].*\(2, 3, 4\)"):
        cpu_kernels.stored_transpose(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("in_dims,features", [(1, 7), (1, (2, 3)), (2, 5)])
def test_projection_gradients_equal_autodiff_of_tensordot(in_dims, features):
    x = normal(2, (2, 3, 4) if in_dims == 1 else (2, 3, 2, 2))
    layer = Projection(features=features, kernel_axes=("a",) * (in_dims + np.ndim(features)),
                       in_dims=in_dims, kernels=CPU)
    params = init(layer, x)
    cot = normal(3, layer.apply({"params": params}, x).shape)

    def ours(p, x):
        return jnp.sum(layer.apply({"params": p}, x) * cot)

    def reference(p, x):
        return jnp.sum(jnp.tensordot(x, p["kernel"], axes=in_dims) * cot)

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(params, x)
    want = jax.grad(reference, argnums=(0, 1))(params, x)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-5, 1e-6), got, want)


def test_tied_logits_gradient_equals_float64_reference():
    """The hand-ordered backward (table gradient as (x^T g)^T) is autodiff's."""
    x, table, g = normal(1, (3, 5, 6)), normal(2, (11, 6)), normal(3, (3, 5, 11))
    dx, dtable = jax.vjp(cpu_kernels.tied_logits, x, table)[1](g)
    x64, t64, g64 = (np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in (x, table, g))
    assert_close(dx, (g64 @ t64).reshape(dx.shape), 1e-5, 1e-6)
    assert_close(dtable, g64.T @ x64, 1e-5, 1e-6)


@pytest.mark.parametrize("kernels,most", [(CPU, 0), (PORTABLE, None)])
def test_weight_gradient_dots_contract_the_last_dim_of_their_left_operand(kernels, most):
    """The point of stored_transpose: with the layer on, no dot of a model's backward
    contracts dimension 0 of its left operand (XLA:CPU runs those in Eigen, not
    YNNPACK); the portable kernel and table gradients are such dots."""
    model = models.EncoderDecoder(tiny_config(kernels=kernels))
    ids = jnp.tile(jnp.arange(3, 19)[None], (4, 1))
    params = init(model, ids, ids)
    loss = lambda p: jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, ids, ids))[..., 3])  # noqa: E731
    hlo = _compiled_cpu_hlo(jax.grad(loss), params)
    assert hlo.count(" dot(") + hlo.count("__ynn_fusion") > 10
    transposed = hlo.count("lhs_contracting_dims={0}")
    assert transposed == most if most is not None else transposed >= 10


# ------------------------------------------------------------------ decoding pieces


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_streamed_matmul_matches_float64(rows):
    x, w_t = normal(0, (rows, 48)), normal(1, (40, 48))
    expected = np.asarray(x, np.float64) @ np.asarray(w_t, np.float64).T
    assert_close(cpu_kernels.streamed_matmul(x, w_t), expected)


def test_streamed_matmul_accumulates_bfloat16_in_float32():
    x, w_t = normal(0, (8, 256)).astype(jnp.bfloat16), normal(1, (16, 256)).astype(jnp.bfloat16)
    out = cpu_kernels.streamed_matmul(x, w_t)
    assert out.dtype == jnp.float32
    expected = np.asarray(x, np.float64) @ np.asarray(w_t, np.float64).T  # exact bf16 values
    assert_close(out, expected, 1e-5, 1e-4)


def test_streamed_matmul_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \(8, 16\) and w_t \(4, 12\)"):
        cpu_kernels.streamed_matmul(jnp.ones((8, 16)), jnp.ones((4, 12)))


@pytest.mark.parametrize("features,in_dims", [(24, 1), ((3, 8), 1), (16, 2)])
def test_projection_streamed_equals_dot(features, in_dims):
    proj = Projection(features, ("a",) * (in_dims + (1 if isinstance(features, int) else 2)),
                      in_dims=in_dims, use_bias=True, kernels=CPU)
    x = normal(0, (2, 3, 4, 4) if in_dims == 2 else (2, 3, 16))
    params = init(proj, x)
    params = {**params, "bias": normal(5, params["bias"].shape)}
    weights = cpu_kernels.decode_weights(params)
    np.testing.assert_array_equal(weights["kernel_t"], params["kernel"].T)
    streamed = proj.apply({"params": params, DW: weights}, x)  # 6 rows: streamed
    assert_close(streamed, proj.apply({"params": params}, x), 1e-5, 1e-6)
    # Over MAX_ROWS rows the dot runs, with or without the weights.
    big = normal(1, (40,) + x.shape[2:])
    assert_close(proj.apply({"params": params, DW: weights}, big),
                 proj.apply({"params": params}, big), 1e-5, 1e-6)


@pytest.mark.parametrize("use_bias,num_kv_heads", [(False, None), (True, 2)])
def test_self_attention_streams_one_fused_qkv(use_bias, num_kv_heads):
    """Q, K and V share one transposed copy [(N + 2K) H, D]; equal to the dot path."""
    mha = MultiHeadAttention(num_heads=4, num_kv_heads=num_kv_heads, use_bias=use_bias,
                             kernels=CPU)
    x = normal(0, (2, 3, 16))
    params = init(mha, x)
    if use_bias:
        params = jax.tree.map(lambda p: p + 0.1 * normal(3, p.shape) if p.ndim <= 2 else p, params)
    weights = cpu_kernels.decode_weights(params)
    kv = num_kv_heads or 4
    assert weights["qkv_t"].shape == ((4 + 2 * kv) * 4, 16)
    assert_close(mha.apply({"params": params, DW: weights}, x), mha.apply({"params": params}, x),
                 1e-5, 1e-6)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_ffn_streamed_equals_dot_and_keeps_nn_dense_parameters(activation):
    class DenseFFN(nn.Module):  # the FFN as it was written with nn.Dense
        @nn.compact
        def __call__(self, x):
            init_k = nn.initializers.xavier_uniform()
            h = nn.relu(nn.Dense(32, kernel_init=init_k, name="wi")(x))
            return nn.Dense(16, kernel_init=init_k, name="wo")(h)

    x = normal(0, (2, 3, 16))
    if activation == "relu":
        jax.tree.map(np.testing.assert_array_equal, init(FeedForward(d_ff=32), x),
                     init(DenseFFN(), x))
    ffn = FeedForward(d_ff=32, activation=activation, kernels=CPU)
    params = init(ffn, x)
    weights = cpu_kernels.decode_weights(params)
    assert_close(ffn.apply({"params": params, DW: weights}, x), ffn.apply({"params": params}, x),
                 1e-5, 1e-6)


# ------------------------------------------------------------------ no hidden state


@pytest.mark.parametrize("kernels", [CPU, PORTABLE])
def test_no_module_creates_decode_weights(kernels):
    """Neither init nor a plain forward with every collection mutable makes them."""
    ids = jnp.ones((2, 6), jnp.int32)
    x = normal(0, (2, 6, 16))
    mha = MultiHeadAttention(num_heads=4, kernels=kernels)
    _, created = mha.apply({"params": init(mha, x)}, x, mutable=True)
    # With every collection mutable, attention also sows its weights (models/capture.py).
    assert set(created) <= {"params", "intermediates"} and DW not in created, set(created)
    for model in (models.EncoderDecoder(tiny_config(kernels=kernels)),
                  models.DecoderOnly(tiny_config(kernels=kernels))):
        args = (ids, ids) if isinstance(model, models.EncoderDecoder) else (ids,)
        variables = jax.eval_shape(model.init, key(), *args)
        assert set(variables) == {"params"}
        _, created = jax.eval_shape(lambda v, m=model, a=args: m.apply(v, *a, mutable=True),
                                    variables)
        assert DW not in created


# ------------------------------------------------------------------ layer off == on


def _families():
    ids, tgt = random_ids(0, (2, 7)), random_ids(1, (2, 6))
    ids = ids.at[1, 5:].set(0)
    return [
        (models.EncoderDecoder, dict(), (ids, tgt), lambda out: out),
        (models.DecoderOnly, dict(norm_position="pre", position_encoding="rope"), (tgt,),
         lambda out: out),
        (models.EncoderOnly, dict(num_classes=3, tie_output=False, ffn_activation="swiglu"),
         (ids,), lambda out: out["token_logits"] + out["class_logits"].sum()),
    ]


@pytest.mark.parametrize("family", range(3), ids=["encdec", "deconly", "enconly"])
def test_every_family_gives_the_same_outputs_and_gradients_with_the_layer_on(family):
    cls, overrides, args, logits_of = _families()[family]
    cfg = tiny_config(dropout_rate=0.1, num_decoder_layers=2, **overrides)
    params = init(cls(cfg), *args)
    results = {}
    for kernels in (PORTABLE, CPU):
        model = cls(cfg.replace(kernels=kernels))

        def loss(p, model=model):
            out = model.apply({"params": p}, *args, deterministic=False,
                              rngs={"dropout": key(7)})
            return jnp.sum(jnp.sin(logits_of(out)))

        results[kernels] = jax.jit(jax.value_and_grad(loss))(params)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-5, 1e-5), results[PORTABLE], results[CPU])


def test_translation_and_generation_are_the_same_with_the_layer_on():
    cfg = tiny_config(num_decoder_layers=2, norm_position="pre")
    src = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    params = init(models.EncoderDecoder(cfg), src, src)
    prompts = jnp.array([[5, 6, 0], [7, 8, 9]])
    lm_params = init(models.DecoderOnly(cfg), prompts)
    runs = {}
    for kernels in (PORTABLE, CPU):
        model = models.EncoderDecoder(cfg.replace(kernels=kernels))
        lm = models.DecoderOnly(cfg.replace(kernels=kernels))
        runs[kernels] = (
            gen.translate_greedy(model, params, src, max_extra=4, eos_id=-1),
            gen.translate_beams(model, params, src, beam_size=3, max_extra=4, eos_id=-1),
            gen.generate(lm, lm_params, prompts, max_new_tokens=5, rng=key(3), eos_id=-1),
        )
    (greedy, (beams, scores), sampled), cpu = runs[PORTABLE], runs[CPU]
    np.testing.assert_array_equal(greedy, cpu[0])
    np.testing.assert_array_equal(beams, cpu[1][0])
    assert_close(scores, cpu[1][1], 1e-5, 1e-5)
    np.testing.assert_array_equal(sampled, cpu[2])


def test_decoding_after_a_parameter_update_uses_the_new_parameters():
    """The decode weights are built from the parameters inside the jitted search,
    so a second call with updated parameters cannot read stale copies."""
    cfg = tiny_config(num_decoder_layers=2)
    src = jnp.array([[5, 6, 7, 8, 9, 0]])
    params = init(models.EncoderDecoder(cfg), src, src)
    updated = jax.tree.map(lambda p: p + 0.5 * normal(11, p.shape), params)
    on = models.EncoderDecoder(cfg.replace(kernels=CPU))
    first = gen.translate_beams(on, params, src, beam_size=2, max_extra=6, eos_id=-1)
    second = gen.translate_beams(on, updated, src, beam_size=2, max_extra=6, eos_id=-1)
    fresh = gen.translate_beams(models.EncoderDecoder(cfg), updated, src, beam_size=2,
                                max_extra=6, eos_id=-1)
    np.testing.assert_array_equal(second[0], fresh[0])
    assert_close(second[1], fresh[1], 1e-5, 1e-5)
    assert not np.allclose(first[1], second[1])


# ------------------------------------------------------------------ the platform decides


def _train_step_gradient(kernels):
    """The training step's gradient (dropout on) of a pre-norm EncoderDecoder, and its args."""
    from transformer_zoo.train.losses import label_smoothed_cross_entropy

    cfg = tiny_config(norm_position="pre", dropout_rate=0.1, kernels=kernels)
    model = models.EncoderDecoder(cfg)
    ids = random_ids(0, (2, 6))
    params = init(model, ids, ids)

    def grad(p, batch, rng):
        def loss(p):
            logits = model.apply({"params": p}, batch, batch, deterministic=False,
                                 rngs={"dropout": rng})
            weights = (batch != 0).astype(jnp.float32)
            total, weight = label_smoothed_cross_entropy(logits, batch, weights, 0.1)
            return total / weight
        return jax.grad(loss)(p)

    return jax.jit(grad), (params, ids, jax.random.key(0))


def _exported(kernels, platform) -> str:
    fn, args = _train_step_gradient(kernels)
    return export.export(fn, platforms=[platform])(*args).mlir_module()


def _switch_operand_ops(text: str) -> set[str]:
    """The ops defining the values that the module's stablehlo.case ops switch on."""
    import re

    names = set(re.findall(r'"stablehlo\.case"\((%[\w#]+)\)', text))
    defined = re.findall(r"^\s*(%[\w#]+) = \"?([\w.]+)", text, flags=re.MULTILINE)
    return {op for name, op in defined if name in names}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("kernels", [PORTABLE, CPU])
def test_a_gradient_exported_for_an_accelerator_has_no_data_dependent_conditional(kernels,
                                                                                   platform):
    text = _exported(kernels, platform)
    assert "stablehlo.if" not in text and "stablehlo.while" not in text
    if kernels == PORTABLE:
        assert "stablehlo.case" not in text
    else:  # only platform_dependent's one-branch switches, on a constant index
        assert _switch_operand_ops(text) <= {"stablehlo.constant", "stablehlo.case"}


def test_a_gradient_exported_for_cpu_with_the_layer_on_has_its_conditionals():
    assert "stablehlo.case" not in _exported(PORTABLE, "cpu")
    ops = _switch_operand_ops(_exported(CPU, "cpu"))
    # A switch on a computed value: the stored values' first == first test.
    assert ops - {"stablehlo.constant", "stablehlo.case"}, ops

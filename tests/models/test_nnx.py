"""models/nnx_bridge.py: every module and family under flax.nnx, equal to linen.

`python tests/models/test_nnx.py` prints README_SNIPPET (the README's NNX section).
"""

import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from zoo_testlib import assert_close, normal, random_ids, tiny_config

from transformer_zoo.configs.common import base_config
from transformer_zoo.models import (
    DecoderBlock,
    DecoderOnly,
    Embed,
    EncoderBlock,
    EncoderDecoder,
    EncoderOnly,
    FeedForward,
    Kernels,
    LayerNorm,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    Projection,
    RMSNorm,
    axes,
    causal_mask,
    decode_step,
    has_cache,
    init_cache,
    linen_variables,
    shift_right,
    to_nnx,
)
from transformer_zoo.train import parallel

pytestmark = pytest.mark.usefixtures("fast_compilation")

B, L, S, D = 2, 6, 7, 16
CASES = ("attention", "decoder_only", "encoder_decoder", "encoder_only")


def _case(name: str, dropout_rate: float = 0.0):
    """(linen module, positional inputs, keyword inputs) of a tiny instance."""
    cfg = tiny_config(dropout_rate=dropout_rate)
    src, tgt = random_ids(1, (B, S)), random_ids(2, (B, L))
    if name == "attention":
        return (MultiHeadAttention(num_heads=4, dropout_rate=dropout_rate),
                (normal(0, (B, L, D)),), {"mask": causal_mask(L)})
    if name == "decoder_only":
        return DecoderOnly(cfg), (tgt,), {}
    if name == "encoder_decoder":
        return EncoderDecoder(cfg), (src, tgt), {}
    return EncoderOnly(tiny_config(dropout_rate=dropout_rate, num_classes=3)), (src,), {}


def _bridged(name: str, dropout_rate: float = 0.0, seed: int = 0):
    module, args, kwargs = _case(name, dropout_rate)
    model = to_nnx(module, *args, rngs=nnx.Rngs(params=seed, dropout=seed + 1), **kwargs)
    return model, module, args, kwargs


# ------------------------------------------------------------------------- init and forward


@pytest.mark.parametrize("name", CASES)
def test_init_with_rngs_creates_linen_parameters_with_logical_axes(name):
    model, module, args, kwargs = _bridged(name)
    boxed = module.init(jax.random.key(0), *args, **kwargs)["params"]
    params = linen_variables(model)["params"]
    shapes = jax.tree.map(jnp.shape, nn.meta.unbox(params))
    assert shapes == jax.tree.map(jnp.shape, nn.meta.unbox(boxed))
    # The linen boxes' logical names survive as nnx.Param metadata, no mesh needed.
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    assert specs == nn.get_partition_spec(boxed)
    names = {n for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, tuple))
             for n in spec}
    assert axes.EMBED in names
    # The parameters come from the "params" stream: another seed, other values.
    other, *_ = _bridged(name, seed=5)
    a, b = (jax.tree.leaves(nn.meta.unbox(linen_variables(m)["params"])) for m in (model, other))
    assert any(not np.allclose(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", CASES)
def test_forward_equals_linen_apply_with_the_same_parameters(name):
    model, module, args, kwargs = _bridged(name)
    want = module.apply(linen_variables(model), *args, **kwargs)
    got = model(*args, **kwargs)
    jax.tree.map(lambda g, w: assert_close(g, w, rtol=1e-6, atol=1e-6), got, want)


@pytest.mark.parametrize("name", CASES)
def test_dropout_uses_the_module_rngs_and_is_off_when_deterministic(name):
    model, module, args, kwargs = _bridged(name, dropout_rate=0.3)
    first, second = (model(*args, deterministic=False, **kwargs) for _ in range(2))
    differences = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()),
                                               first, second))
    assert max(differences) > 1e-3, "two training calls drew the same dropout masks"
    eval_a, eval_b = model(*args, **kwargs), model(*args, deterministic=True, **kwargs)
    want = module.apply(linen_variables(model), *args, **kwargs)
    for got in (eval_a, eval_b):
        jax.tree.map(lambda g, w: assert_close(g, w, rtol=1e-6, atol=1e-6), got, want)


def test_dropout_falls_back_to_the_params_stream():
    module, args, _ = _case("decoder_only", dropout_rate=0.3)
    model = to_nnx(module, *args, rngs=nnx.Rngs(0))  # one "default" stream only
    first, second = (model(*args, deterministic=False) for _ in range(2))
    assert float(jnp.abs(first - second).max()) > 1e-3


@pytest.mark.parametrize("name", CASES[1:])
def test_cpu_kernels_give_the_portable_numbers(name):
    module, args, _ = _case(name)
    cpu = to_nnx(module.clone(config=module.config.replace(kernels=Kernels.CPU)), *args,
                 rngs=nnx.Rngs(0))
    want = module.apply(linen_variables(cpu), *args)
    jax.tree.map(lambda g, w: assert_close(g, w), cpu(*args), want)
    if name == "decoder_only":
        tokens = shift_right(args[0], module.config.bos_id)
        init_cache(cpu, jnp.zeros_like(tokens))
        steps = [decode_step(cpu, tokens[:, t:t + 1]) for t in range(L)]
        assert_close(jnp.concatenate(steps, axis=1), want)


@pytest.mark.parametrize("module, args", [
    (Embed(32, D), (random_ids(0, (B, L)),)),
    (FeedForward(32, dropout_rate=0.1), (normal(0, (B, L, D)),)),
    (LayerNorm(), (normal(0, (B, L, D)),)),
    (RMSNorm(), (normal(0, (B, L, D)),)),
    (Projection((4, 4), (axes.EMBED, axes.HEADS, axes.HEAD_DIM)), (normal(0, (B, L, D)),)),
    (LearnedPositionalEmbedding(16, D), (jnp.arange(L)[None],)),
    (EncoderBlock(tiny_config()), (normal(0, (B, L, D)), None)),
    (DecoderBlock(tiny_config(), cross_attention=False), (normal(0, (B, L, D)), None)),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_other_public_modules_equal_linen(module, args):
    model = to_nnx(module, *args, rngs=nnx.Rngs(0))
    assert_close(model(*args), module.apply(linen_variables(model), *args), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------- decoding


def test_attention_cached_decoding_equals_the_causal_forward():
    model, _, (x,), kwargs = _bridged("attention")
    full = model(x, **kwargs)
    init_cache(model, jnp.zeros((1, 3, D)))  # replaced by the next call
    init_cache(model, jnp.zeros_like(x))
    steps = [decode_step(model, x[:, :2])]  # a prefill of two, then one at a time
    steps += [decode_step(model, x[:, t:t + 1]) for t in range(2, L)]
    assert_close(jnp.concatenate(steps, axis=1), full)


def test_decoder_only_cached_decoding_under_nnx_jit_equals_the_forward():
    model, _, (targets,), _ = _bridged("decoder_only")
    full = model(targets)
    tokens = shift_right(targets, model.to_nnx__module.config.bos_id)
    init_cache(model, jnp.zeros_like(tokens))
    step = nnx.jit(decode_step)  # the cache update leaves the jitted step through NNX
    steps = [step(model, tokens[:, t:t + 1]) for t in range(L)]
    assert_close(jnp.concatenate(steps, axis=1), full)
    assert int(nnx.to_pure_dict(nnx.state(model, nnx.Cache))["decoder"]["position"]) == L


def test_encoder_decoder_cached_decoding_equals_the_forward():
    model, module, (src, tgt), _ = _bridged("encoder_decoder")
    cfg = module.config
    full = model(src, tgt)
    encoded, src_seg = model.encode(src), (src != cfg.pad_id).astype(jnp.int32)
    tokens = shift_right(tgt, cfg.bos_id)
    init_cache(model, encoded, src_seg, jnp.zeros_like(tokens), method="decode")
    # Zeros after the cache-creating call: only cached cross keys/values give the forward.
    steps = [decode_step(model, jnp.zeros_like(encoded), src_seg, tokens[:, t:t + 1],
                         method="decode") for t in range(L)]
    assert_close(jnp.concatenate(steps, axis=1), full)


def test_init_cache_replaces_the_previous_cache():
    model, _, (targets,), _ = _bridged("decoder_only")
    tokens = shift_right(targets, model.to_nnx__module.config.bos_id)
    init_cache(model, jnp.zeros_like(tokens))
    first = decode_step(model, tokens)
    init_cache(model, jnp.zeros((1, 2 * L), jnp.int32))  # another batch and length
    assert nnx.to_pure_dict(nnx.state(model, nnx.Cache))["decoder"]["layer_0"]["self_attention"][
        "cached_key"].shape[:3:2] == (1, 2 * L)
    init_cache(model, jnp.zeros_like(tokens))
    assert_close(decode_step(model, tokens), first)
    assert_close(first, model(targets))


def test_errors_name_the_problem():
    model, module, args, _ = _bridged("decoder_only")
    with pytest.raises(ValueError, match="no KV cache.*init_cache"):
        decode_step(model, args[0])
    with pytest.raises(ValueError, match="decode.*init_cache"):
        to_nnx(module, *args, rngs=nnx.Rngs(0), decode=True)
    with pytest.raises(ValueError, match="mutable"):
        init_cache(model, *args, mutable=["cache"])
    with pytest.raises(ValueError, match="no 'params'.*'dropout'"):
        to_nnx(module, *args, rngs=nnx.Rngs(dropout=0))
    with pytest.raises(TypeError, match="nnx.Rngs"):
        to_nnx(module, *args, rngs=0)
    with pytest.raises(TypeError, match="linen Module"):
        to_nnx(model, *args, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="to_nnx"):
        decode_step(module, *args)
    embed = to_nnx(Embed(32, D), args[0], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Embed created no 'cache'"):
        init_cache(embed, normal(0, (B, L, D)), method="attend")
    assert not has_cache(embed)


# ------------------------------------------------------------------------ training and mesh


def _loss(name, model, args):
    out = model(*args, deterministic=False)
    logits, labels = (out["token_logits"], args[0]) if name == "encoder_only" else (out, args[-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("name", CASES[1:])
def test_nnx_jit_and_optimizer_training_lowers_the_loss(name):
    model, _, args, _ = _bridged(name, dropout_rate=0.1)
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, *args):
        loss, grads = nnx.value_and_grad(lambda m: _loss(name, m, args))(model)
        optimizer.update(model, grads)
        return loss

    def eval_loss():
        out = model(*args)
        logits = out["token_logits"] if name == "encoder_only" else out
        labels = args[0] if name == "encoder_only" else args[-1]
        return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())

    before = eval_loss()
    losses = [float(train_step(model, optimizer, *args)) for _ in range(6)]
    assert eval_loss() < 0.8 * before, (before, losses)
    assert int(optimizer.step[...]) == 6


def test_to_nnx_under_a_mesh_with_the_project_rules_equals_no_mesh():
    rules = parallel.validate_rules(base_config().parallel.logical_axis_rules)
    mesh = parallel.make_mesh((1, 1, 1), jax.devices()[:1])
    plain, module, (targets,), _ = _bridged("decoder_only")
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        model = to_nnx(module, targets, rngs=nnx.Rngs(params=0, dropout=1))
        shardings = parallel.param_shardings(linen_variables(model)["params"], mesh, rules)
        params = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(params, jax.device_put(nnx.to_pure_dict(params), shardings))
        nnx.update(model, params)
        placed = jax.tree.map(lambda p: p.sharding,
                              nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        logits = nnx.jit(lambda m, ids: m(ids))(model, targets)
    assert placed == shardings  # the module's parameters are where train/parallel.py put them
    specs = {s.spec for s in jax.tree.leaves(placed)}
    assert jax.sharding.PartitionSpec("fsdp", "tensor") in specs  # embed x mlp
    assert_close(logits, plain(targets), rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=0, atol=0),
                 nn.meta.unbox(linen_variables(model)["params"]),
                 nn.meta.unbox(linen_variables(plain)["params"]))


# ---------------------------------------------------------------------------------- README

README_SNIPPET = '''\
## From flax.nnx

Every module and family also runs under `flax.nnx`, the API Flax now recommends:
`transformer_zoo.models.nnx_bridge` wraps the same linen code in `nnx.bridge.ToNNX`.

- `to_nnx(module, *example_inputs, rngs=nnx.Rngs(params=0, dropout=1))` initialises from
  example inputs, like linen's `init`. It creates the parameters without eager sharding,
  so it works with and without a mesh: each `nnx.Param` keeps its logical axis names
  (`nnx.get_partition_spec`), and train/parallel.py places them on a mesh as for linen.
- Call the result as linen's `apply` without the variables: `model(ids,
  deterministic=False)`, `model.encode(inputs)`. Dropout draws from the module's own
  "dropout" stream (or "params" when there is none), which advances on every call.
- `init_cache(model, zeros [B, S_max])` creates or replaces the KV cache, and
  `decode_step(model, ids [B, T])` feeds tokens and returns their logits; the cache
  lives in the module as `nnx.Cache` variables. EncoderDecoder decodes with
  `method="decode"` and `(encoded, source segmentation, ids)`.
- `linen_variables(model)` returns `{"params": ...}` in linen's layout (boxes kept) for
  `module.apply`, train/parallel.py and, after `nn.meta.unbox`, models/generate.py.

```python
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from transformer_zoo.configs.common import base_config
from transformer_zoo.models import (DecoderOnly, ModelConfig, MultiHeadAttention, causal_mask,
                                    decode_step, init_cache, linen_variables, shift_right,
                                    to_nnx)
from transformer_zoo.train import parallel

# A single module: x [B, T, D], causal mask [1, 1, T, T].
x = jnp.ones((2, 5, 16))
attention = to_nnx(MultiHeadAttention(num_heads=4), x, mask=causal_mask(5), rngs=nnx.Rngs(0))
y = attention(x, mask=causal_mask(5))  # [2, 5, 16]

config = ModelConfig(vocab_size=32, d_model=16, num_heads=4, d_ff=32, num_decoder_layers=1,
                     dropout_rate=0.1, max_length=16)
ids = jnp.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])  # [B, L], no PAD
model = to_nnx(DecoderOnly(config), ids, rngs=nnx.Rngs(params=0, dropout=1))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def loss_fn(model, ids):
    logits = model(ids, deterministic=False)  # [B, L, V]; new dropout masks each call
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()


@nnx.jit
def train_step(model, optimizer, ids):
    loss, grads = nnx.value_and_grad(loss_fn)(model, ids)
    optimizer.update(model, grads)
    return loss


losses = [float(train_step(model, optimizer, ids)) for _ in range(5)]
assert losses[-1] < losses[0], losses

# KV-cached decoding gives the teacher-forced forward's logits.
tokens = shift_right(ids, config.bos_id)  # what the forward feeds the decoder
init_cache(model, jnp.zeros_like(tokens))  # S_max = L slots
step = nnx.jit(decode_step)
logits = jnp.concatenate([step(model, tokens[:, t:t + 1]) for t in range(6)], axis=1)
assert jnp.allclose(logits, model(ids), atol=1e-5)

# Under a mesh with the project's logical axis rules (one device here).
rules = parallel.validate_rules(base_config().parallel.logical_axis_rules)
mesh = parallel.make_mesh((1, 1, 1), jax.devices()[:1])
with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    model = to_nnx(DecoderOnly(config), ids, rngs=nnx.Rngs(params=0, dropout=1))
    shardings = parallel.param_shardings(linen_variables(model)["params"], mesh, rules)
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, jax.device_put(nnx.to_pure_dict(params), shardings))
    nnx.update(model, params)
    logits = nnx.jit(lambda model, ids: model(ids))(model, ids)  # [B, L, V]
```
'''


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)


def test_readme_snippet_runs():
    blocks = _python_blocks(README_SNIPPET)
    assert len(blocks) == 1
    namespace = {"__name__": "readme_nnx"}
    exec(compile(blocks[0], "README.md (From flax.nnx)", "exec"), namespace)
    assert namespace["y"].shape == (2, 5, 16)
    assert namespace["logits"].shape == (2, 6, 32)


if __name__ == "__main__":
    sys.stdout.write(README_SNIPPET)

"""Typed variants (models/variants.py): every family accepted as enum or string,
held as the enum, and every wrong value (unknown or wrong case) a ValueError that
names the field, the value and the choices, in ModelConfig and in each module.
Also: `auto` attention chooses per platform compiled for, not per host."""

import jax
import jax.numpy as jnp
import pytest
from zoo_testlib import normal, tiny_config

from transformer_zoo.models import (
    AttentionImpl,
    Embed,
    FeedForward,
    FfnActivation,
    Kernels,
    ModelConfig,
    MultiHeadAttention,
    Norm,
    NormPosition,
    Pooling,
    PositionEncoding,
    ScoreFn,
    dot_product_attention,
    make_attention_mask,
)
from transformer_zoo.models.norms import make_norm
from transformer_zoo.models.projection import Projection

FAMILIES = {
    "position_encoding": PositionEncoding,
    "norm": Norm,
    "norm_position": NormPosition,
    "ffn_activation": FfnActivation,
    "score_fn": ScoreFn,
    "pooling": Pooling,
    "attention_impl": AttentionImpl,
    "kernels": Kernels,
}


def _valid(field, member):
    """Overrides that make `member` of `field` a valid config."""
    extra = {}
    if member == AttentionImpl.LOCAL:
        extra["attention_window"] = 4
    return {field: member, **extra}


@pytest.mark.parametrize("field", sorted(FAMILIES))
def test_model_config_takes_each_member_or_its_string_and_holds_the_member(field):
    for member in FAMILIES[field]:
        for spelling in (member, member.value):
            cfg = tiny_config(**_valid(field, spelling))
            assert getattr(cfg, field) is member
            assert getattr(cfg, field) == member.value  # members are strings


@pytest.mark.parametrize("field", sorted(FAMILIES))
def test_model_config_rejects_wrong_case_and_unknown_values(field):
    member = next(iter(FAMILIES[field]))
    for bad in (member.value.upper(), member.value.title(), "unknown"):
        choices = [m.value for m in FAMILIES[field]]
        with pytest.raises(ValueError, match=rf"ModelConfig\.{field}='{bad}' is unknown") as err:
            ModelConfig(**{field: bad})
        if field != "attention_impl":  # the registry may hold more names
            assert str(choices) in str(err.value)


MODULES = [
    (lambda v: MultiHeadAttention(num_heads=2, position_encoding=v),
     "MultiHeadAttention.position_encoding", PositionEncoding),
    (lambda v: MultiHeadAttention(num_heads=2, score_fn=v), "MultiHeadAttention.score_fn",
     ScoreFn),
    (lambda v: MultiHeadAttention(num_heads=2, kernels=v), "MultiHeadAttention.kernels", Kernels),
    (lambda v: MultiHeadAttention(num_heads=2, attention_impl=v),
     "MultiHeadAttention.attention_impl", AttentionImpl),
    (lambda v: FeedForward(d_ff=8, activation=v), "FeedForward.activation", FfnActivation),
    (lambda v: FeedForward(d_ff=8, kernels=v), "FeedForward.kernels", Kernels),
    (lambda v: Projection(4, ("a", "b"), kernels=v), "Projection.kernels", Kernels),
    (lambda v: Embed(8, 4, kernels=v), "Embed.kernels", Kernels),
    (lambda v: make_norm(v, 1e-6, jnp.float32, jnp.float32), "norm", Norm),
]


@pytest.mark.parametrize("build,field,kind", MODULES, ids=[m[1] for m in MODULES])
def test_standalone_modules_validate_at_construction(build, field, kind):
    for member in kind:
        build(member)
        build(member.value)
    good = next(iter(kind)).value
    for bad in (good.upper(), "nope"):
        with pytest.raises(ValueError, match=rf"{field}='{bad}' is unknown; choose from"):
            build(bad)


def test_rope_really_rotates_in_a_standalone_module():
    """The bug a typed field prevents: 'RoPE' used to run silently without RoPE."""
    x = normal(0, (1, 5, 8))
    outs = {}
    for pe in ("rope", "none"):
        mha = MultiHeadAttention(num_heads=2, position_encoding=pe)
        mask = make_attention_mask(None, q_len=5, causal=True)
        params = mha.init(jax.random.key(0), x, mask=mask)
        outs[pe] = mha.apply(params, x, mask=mask)
    assert float(jnp.abs(outs["rope"] - outs["none"]).max()) > 1e-3
    with pytest.raises(ValueError, match="position_encoding='RoPE' is unknown"):
        MultiHeadAttention(num_heads=2, position_encoding="RoPE")


def test_attention_window_is_validated():
    with pytest.raises(ValueError, match="attention_window must be >= 1, got 0"):
        ModelConfig(attention_window=0)
    with pytest.raises(ValueError, match="attention_window must be >= 1, got -2"):
        MultiHeadAttention(num_heads=2, attention_window=-2)
    with pytest.raises(ValueError, match="attention_impl='local' needs attention_window"):
        ModelConfig(attention_impl="local")


@pytest.mark.parametrize("platform,marker", [("cuda", "triton"), ("tpu", "tpu_custom_call"),
                                             ("cpu", "stablehlo.dot_general")])
def test_auto_attention_chooses_for_the_platform_compiled_for(platform, marker):
    """Lowered from this CPU host: a Pallas kernel for GPU and TPU, xla for CPU."""
    q = normal(0, (1, 16, 2, 8)).astype(jnp.bfloat16)
    mask = make_attention_mask(None, q_len=16, causal=True)
    fn = jax.jit(lambda q: dot_product_attention(q, q, q, mask=mask, impl="auto"))
    text = fn.trace(q).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
    others = {"triton", "tpu_custom_call"} - {marker}
    assert not any(other in text for other in others)

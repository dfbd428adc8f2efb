"""ModelConfig validation and the paper presets (parameter counts of Table 3)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from zoo_testlib import key

from transformer_zoo.models import PRESETS, EncoderDecoder, ModelConfig, get_preset

pytestmark = pytest.mark.usefixtures("fast_compilation")


def _num_params(cfg: ModelConfig) -> int:
    ids = jnp.ones((1, 8), jnp.int32)
    shapes = jax.eval_shape(EncoderDecoder(cfg).init, key(0), ids, ids)["params"]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize(("preset", "paper_millions"), [("base", 65), ("big", 213)])
def test_paper_presets_match_the_paper_parameter_counts(preset, paper_millions):
    cfg = get_preset(preset)
    n = _num_params(cfg)
    assert abs(n / 1e6 - paper_millions) / paper_millions < 0.05, n
    assert cfg.norm_position == "post" and cfg.position_encoding == "sinusoidal"
    assert cfg.share_embeddings and cfg.tie_output and cfg.ffn_activation == "relu"


def test_base_preset_is_the_default_config():
    assert get_preset("base") == ModelConfig()
    big = get_preset("big")
    assert (big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (1024, 4096, 16, 0.3)


def test_overrides_and_replace_are_validated():
    cfg = get_preset("tiny", num_heads=2)
    assert cfg.num_heads == 2 and cfg.d_model == PRESETS["tiny"]["d_model"]
    assert cfg.replace(norm="rmsnorm").norm == "rmsnorm"
    with pytest.raises(ValueError, match="norm_position='middle' is unknown"):
        cfg.replace(norm_position="middle")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(512)  # type: ignore[misc]  # keyword-only


def test_dtypes_are_normalised():
    cfg = ModelConfig(dtype="bfloat16", param_dtype=jnp.float32)
    assert cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.float32


def test_resolved_properties():
    cfg = ModelConfig(d_model=64, num_heads=8, num_kv_heads=2, vocab_size=100,
                      input_vocab_size=50, share_embeddings=False)
    assert (cfg.resolved_head_dim, cfg.resolved_num_kv_heads) == (8, 2)
    assert cfg.resolved_input_vocab_size == 50
    assert ModelConfig(d_model=60, num_heads=7, head_dim=10).resolved_head_dim == 10


BAD_CONFIGS = [
    (dict(d_model=512, num_heads=7), r"d_model=512 is not divisible by num_heads=7"),
    (dict(num_heads=8, num_kv_heads=3), r"num_heads=8 is not divisible by num_kv_heads=3"),
    (dict(num_kv_heads=0), r"num_kv_heads must be positive, got 0"),
    (dict(num_heads=0), r"num_heads must be positive, got 0"),
    (dict(d_model=60, num_heads=4, position_encoding="rope"), r"even head_dim, got 15"),
    (dict(position_encoding="relative"), r"position_encoding='relative' is unknown"),
    (dict(norm="batchnorm"), r"norm='batchnorm' is unknown"),
    (dict(ffn_activation="tanh"), r"ffn_activation='tanh' is unknown"),
    (dict(attention_impl="cuda"), r"attention_impl='cuda' is unknown"),
    (dict(score_fn="cosine"), r"score_fn='cosine' is unknown"),
    (dict(norm_position="sandwich"), r"norm_position='sandwich' is unknown"),
    (dict(dropout_rate=1.0), r"dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(vocab_size=0), r"vocab_size must be positive, got 0"),
    (dict(input_vocab_size=100), r"share_embeddings=True needs input_vocab_size \(100\)"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONFIGS,
                         ids=[m.split("=")[0].split()[0] for _, m in BAD_CONFIGS])
def test_bad_config_raises_value_error_naming_field_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"preset 'huge' is unknown; choose from \['base'"):
        get_preset("huge")

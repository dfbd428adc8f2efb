"""The three families: invariants (causality, padding, packing, caching), variants, dtypes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_testlib import (
    assert_close,
    decoder_only_cached,
    encoder_decoder_cached,
    init,
    key,
    random_ids,
    tiny_config,
)

from transformer_zoo.models import DecoderOnly, EncoderDecoder, EncoderOnly, axes, shift_right

pytestmark = pytest.mark.usefixtures("fast_compilation")

B, L = 2, 6


def _apply(model, params, *args, **kwargs):
    return model.apply({"params": params}, *args, **kwargs)


def test_shift_right_inserts_bos_at_each_segment_start():
    targets = jnp.array([[5, 6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(shift_right(targets, 2), [[2, 5, 6, 7, 8, 9]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0]])
    np.testing.assert_array_equal(shift_right(targets, 2, pos), [[2, 5, 6, 2, 8, 2]])


def test_decoder_only_logits_are_causal():
    model = DecoderOnly(tiny_config())
    targets = random_ids(0, (B, L))
    params = init(model, targets)
    logits = _apply(model, params, targets)
    changed = targets.at[:, 3:].set(random_ids(1, (B, L - 3)))
    new = _apply(model, params, changed)
    # Logits at t predict targets[t] from targets[<t]: positions <= 3 cannot change.
    np.testing.assert_array_equal(np.asarray(new)[:, :4], np.asarray(logits)[:, :4])
    assert not np.allclose(new[:, 4:], logits[:, 4:], atol=1e-4)


def test_encoder_decoder_ignores_padded_tokens():
    model = EncoderDecoder(tiny_config())
    inputs = random_ids(2, (B, L)).at[0, 4:].set(0)
    targets = random_ids(3, (B, L)).at[1, 3:].set(0)
    params = init(model, inputs, targets)
    logits = np.asarray(_apply(model, params, inputs, targets))
    # Other ids in the padded slots, declared padding by the segment ids.
    in_seg = (inputs != 0).astype(jnp.int32)
    tgt_seg = (targets != 0).astype(jnp.int32)
    garbage_in = inputs.at[0, 4:].set(jnp.array([7, 9]))
    garbage_tgt = targets.at[1, 3:].set(jnp.array([4, 5, 6]))
    out = np.asarray(_apply(model, params, garbage_in, garbage_tgt, in_seg, tgt_seg))
    valid = np.asarray(tgt_seg) != 0
    assert_close(out[valid], logits[valid])
    # Without the segment ids the same ids are tokens, and the logits move.
    assert not np.allclose(_apply(model, params, garbage_in, targets)[0], logits[0], atol=1e-4)


@pytest.mark.parametrize("position_encoding", ["none", "sinusoidal"])
def test_encoder_permutation_equivariance_needs_no_positions(position_encoding):
    model = EncoderOnly(tiny_config(position_encoding=position_encoding))
    inputs = random_ids(4, (B, L))
    perm = np.array([2, 5, 0, 4, 1, 3])
    params = init(model, inputs)
    out = np.asarray(_apply(model, params, inputs)["token_logits"])
    out_perm = np.asarray(_apply(model, params, inputs[:, perm])["token_logits"])
    equivariant = np.allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-5)
    assert equivariant == (position_encoding == "none")


DECODE_VARIANTS = {
    "sinusoidal": dict(),
    "learned": dict(position_encoding="learned"),
    "rope": dict(position_encoding="rope"),
    "alibi": dict(position_encoding="alibi"),
    "gqa": dict(num_kv_heads=2),
}


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
def test_decoder_only_cached_decoding_equals_forward(variant):
    model = DecoderOnly(tiny_config(norm_position="pre", **DECODE_VARIANTS[variant]))
    targets = random_ids(5, (B, L))
    params = init(model, targets)
    full = _apply(model, params, targets)
    assert_close(decoder_only_cached(model, params, targets), full)
    assert_close(decoder_only_cached(model, params, targets, prefill=4), full)


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
def test_encoder_decoder_cached_decoding_equals_forward(variant):
    model = EncoderDecoder(tiny_config(**DECODE_VARIANTS[variant]))
    inputs = random_ids(6, (B, L)).at[1, 5:].set(0)
    targets = random_ids(7, (B, L))
    params = init(model, inputs, targets)
    full = _apply(model, params, inputs, targets)
    # Later steps get a zeroed encoder output: the cross-attention keys must be cached.
    assert_close(encoder_decoder_cached(model, params, inputs, targets, poison_encoded=True),
                 full)
    if variant == "sinusoidal":
        assert_close(encoder_decoder_cached(model, params, inputs, targets, prefill=3), full)


def _packed_and_alone():
    """Row 0 packs A (3 tokens) and B (2 tokens); row 1 is C alone. Unpacked: A, B alone."""
    packed = jnp.array([[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 14, 15]])
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    alone = jnp.array([[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0]])
    return packed, seg, pos, alone


def _assert_packed_equals_alone(packed_logits, alone_logits):
    packed_logits, alone_logits = np.asarray(packed_logits), np.asarray(alone_logits)
    assert_close(packed_logits[0, :3], alone_logits[0, :3])
    assert_close(packed_logits[0, 3:5], alone_logits[1, :2])


@pytest.mark.parametrize("position_encoding", ["sinusoidal", "rope", "alibi"])
def test_decoder_only_packed_equals_unpacked(position_encoding):
    model = DecoderOnly(tiny_config(position_encoding=position_encoding))
    packed, seg, pos, alone = _packed_and_alone()
    params = init(model, alone)
    _assert_packed_equals_alone(_apply(model, params, packed, seg, pos),
                                _apply(model, params, alone))


@pytest.mark.parametrize("position_encoding", ["sinusoidal", "learned"])
def test_encoder_decoder_packed_equals_unpacked(position_encoding):
    model = EncoderDecoder(tiny_config(position_encoding=position_encoding))
    tgt_packed, tgt_seg, tgt_pos, tgt_alone = _packed_and_alone()
    # Sources of other lengths (2 and 4), so source and target segments do not line up.
    src_packed = jnp.array([[16, 17, 18, 19, 20, 21], [22, 23, 24, 25, 0, 0]])
    src_seg = jnp.array([[1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 0, 0]])
    src_pos = jnp.array([[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 0, 0]])
    src_alone = jnp.array([[16, 17, 0, 0, 0, 0], [18, 19, 20, 21, 0, 0]])
    params = init(model, src_alone, tgt_alone)
    _assert_packed_equals_alone(
        _apply(model, params, src_packed, tgt_packed, src_seg, tgt_seg, src_pos, tgt_pos),
        _apply(model, params, src_alone, tgt_alone))


def _family_inputs(family):
    """Ids with trailing padding in row 0: fully masked query rows in every family."""
    ids = random_ids(8, (B, L)).at[0, 4:].set(0)
    return (ids, ids[:, ::-1]) if family is EncoderDecoder else (ids,)


def _logits(out):
    return out["class_logits"] if isinstance(out, dict) else out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [EncoderDecoder, DecoderOnly, EncoderOnly],
                         ids=lambda f: f.__name__)
def test_forward_backward_under_jit_with_dropout(family, dtype):
    cfg = tiny_config(dtype=dtype, num_classes=3, dropout_rate=0.1, attention_dropout_rate=0.1,
                      activation_dropout_rate=0.1)
    model = family(cfg)
    args = _family_inputs(family)
    params = init(model, *args)

    @jax.jit
    def loss_and_grads(params, rng):
        def loss(params):
            out = model.apply({"params": params}, *args, deterministic=False,
                              rngs={"dropout": rng})
            logits = _logits(out)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), out

        return jax.value_and_grad(loss, has_aux=True)(params)

    (loss, out), grads = loss_and_grads(params, key(1))
    (_, out2), _ = loss_and_grads(params, key(2))
    leaves = ([v for k, v in out.items() if k.endswith("logits")] if isinstance(out, dict)
              else [out])
    for logits in leaves:
        assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))
    if isinstance(out, dict):  # hidden states are in the compute dtype
        assert out["hidden"].dtype == model.config.dtype
    assert np.isfinite(loss)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.dtype == p.dtype == jnp.float32
        assert np.all(np.isfinite(g))
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))
    assert not np.allclose(_logits(out), _logits(out2))  # dropout is on


VARIANTS = {
    "relu": (dict(ffn_activation="relu"), ["encoder/layer_0/ffn/wi"], ["wi_gate"]),
    "gelu": (dict(ffn_activation="gelu"), ["encoder/layer_0/ffn/wi"], ["wi_gate"]),
    "swiglu": (dict(ffn_activation="swiglu"), ["decoder/layer_0/ffn/wi_gate"], []),
    "geglu": (dict(ffn_activation="geglu"), ["encoder/layer_0/ffn/wi_gate"], []),
    "layernorm": (dict(norm="layernorm"),
                  ["encoder/layer_0/ffn_residual/norm/bias"], ["final_norm"]),
    "rmsnorm": (dict(norm="rmsnorm"), ["decoder/layer_0/attention_residual/norm/scale"],
                ["norm/bias"]),
    "pre": (dict(norm_position="pre"),
            ["encoder/final_norm/scale", "decoder/final_norm/scale"], []),
    "untied": (dict(tie_output=False), ["decoder/logits/kernel"], []),
    "unshared": (dict(share_embeddings=False, input_vocab_size=40),
                 ["source_embed/embedding", "target_embed/embedding"], []),
    "shared": (dict(), ["target_embed/embedding"], ["source_embed", "decoder/logits"]),
}


def _paths(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_run_and_have_the_expected_parameters(variant):
    overrides, present, absent = VARIANTS[variant]
    model = EncoderDecoder(tiny_config(**overrides))
    inputs, targets = random_ids(9, (B, L)), random_ids(10, (B, L))
    params = init(model, inputs, targets)
    paths = _paths(params)
    for p in present:
        assert any(k.startswith(p) for k in paths), (p, sorted(paths))
    for a in absent:
        assert not any(a in k for k in paths), (a, sorted(paths))
    if variant == "untied":
        assert paths["decoder/logits/kernel"].shape == (16, 32)
    if variant == "unshared":
        assert paths["source_embed/embedding"].shape == (40, 16)
        assert paths["target_embed/embedding"].shape == (32, 16)
    logits = _apply(model, params, inputs, targets)
    assert logits.shape == (B, L, 32) and np.all(np.isfinite(logits))


def test_tied_logits_are_final_hidden_state_times_embedding():
    model = DecoderOnly(tiny_config(norm_position="pre"))
    targets = random_ids(11, (B, L))
    params = init(model, targets)
    logits, state = model.apply({"params": params}, targets, capture_intermediates=True,
                                mutable=["intermediates"])
    hidden = state["intermediates"]["decoder"]["final_norm"]["__call__"][0]
    table = np.asarray(params["embed"]["embedding"], np.float64)
    assert_close(logits, np.asarray(hidden, np.float64) @ table.T)


def test_encoder_only_heads():
    model = EncoderOnly(tiny_config(num_classes=3, tie_output=False))
    inputs = random_ids(12, (B, L)).at[0, 4:].set(0)
    params = init(model, inputs)
    assert params["token_head"]["kernel"].shape == (16, 32)
    assert params["classifier"]["kernel"].shape == (16, 3)
    out = _apply(model, params, inputs)
    assert out["token_logits"].shape == (B, L, 32) and out["class_logits"].shape == (B, 3)
    # The pooled class logits ignore the padding.
    garbage = _apply(model, params, inputs.at[0, 4:].set(9), (inputs != 0).astype(jnp.int32))
    assert_close(garbage["class_logits"], out["class_logits"])


@pytest.mark.parametrize("family", [EncoderDecoder, DecoderOnly, EncoderOnly],
                         ids=lambda f: f.__name__)
def test_every_parameter_carries_logical_axis_names(family):
    cfg = tiny_config(num_classes=3, tie_output=False, share_embeddings=False,
                      input_vocab_size=40, ffn_activation="swiglu", norm_position="pre",
                      position_encoding="learned", score_fn="additive", num_kv_heads=2)
    boxed = jax.eval_shape(family(cfg).init, key(0), *_family_inputs(family))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert len(leaves) > 10
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned), type(leaf)
        names = leaf.names
        assert len(names) == leaf.value.ndim, (names, leaf.value.shape)
        assert set(names) <= set(axes.ALL), names


def test_learned_positions_reject_long_sequences():
    model = DecoderOnly(tiny_config(position_encoding="learned", max_length=16))
    with pytest.raises(ValueError, match=r"sequence length 17 > max_length=16"):
        jax.eval_shape(model.init, key(0), jnp.ones((1, 17), jnp.int32))

"""MultiHeadAttention: the shape table, flax parity, GQA/MQA, additive scores, KV cache."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import softmax
from zoo_testlib import assert_close, init, key, normal

from transformer_zoo.models import MultiHeadAttention, causal_mask, dot_product_attention

pytestmark = pytest.mark.usefixtures("fast_compilation")


def test_shape_table():
    """B=2, N(seq)=5, d_model=12, h=3, d_h=4: every intermediate has the explainer's shape."""
    x = normal(0, (2, 5, 12))
    mha = MultiHeadAttention(num_heads=3, use_bias=True)
    params = init(mha, x)
    for name in ("query", "key", "value"):
        assert params[name]["kernel"].shape == (12, 3, 4), name  # 3 heads x 4 dims
    assert params["out"]["kernel"].shape == (3, 4, 12)
    out, weights = mha.apply({"params": params}, x, return_weights=True)
    assert out.shape == (2, 5, 12)
    assert weights.shape == (2, 3, 5, 5)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    # Rebuild the output head by head: 4 dims per head, concatenated to 12.
    proj = {n: jnp.einsum("btd,dnh->btnh", x, params[n]["kernel"]) + params[n]["bias"]
            for n in ("query", "key", "value")}
    heads = dot_product_attention(proj["query"], proj["key"], proj["value"])
    assert heads.shape == (2, 5, 3, 4)
    concat = heads.reshape(2, 5, 12)
    want = concat @ params["out"]["kernel"].reshape(12, 12) + params["out"]["bias"]
    assert_close(out, want)


@pytest.mark.parametrize("use_bias", [True, False])
def test_parity_with_flax_multi_head_attention(use_bias):
    x = normal(1, (2, 6, 16))
    enc = normal(2, (2, 4, 16))
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 6, 6)) < 0.7).at[..., 0].set(True)
    ours = MultiHeadAttention(num_heads=4, use_bias=use_bias)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, use_bias=use_bias)
    params = init(ours, x)
    flax_params = theirs.init(key(0), x)["params"]
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, flax_params)
    got = ours.apply({"params": params}, x, mask=mask)
    assert_close(got, theirs.apply({"params": params}, x, mask=mask))
    cross = ours.apply({"params": params}, x, enc)
    assert_close(cross, theirs.apply({"params": params}, x, enc))


def test_gqa_with_k_equal_n_is_mha_and_grouped_kv_equals_repeated_heads():
    x = normal(3, (2, 6, 16))
    mha = MultiHeadAttention(num_heads=4)
    params = init(mha, x)
    full_kv = MultiHeadAttention(num_heads=4, num_kv_heads=4)
    np.testing.assert_array_equal(full_kv.apply({"params": params}, x),
                                  mha.apply({"params": params}, x))
    gqa = MultiHeadAttention(num_heads=4, num_kv_heads=2)
    gqa_params = init(gqa, x, seed=1)
    assert gqa_params["key"]["kernel"].shape == (16, 2, 4)
    # Query head n uses key/value head n // G: repeating each kv head G times is MHA.
    repeated = {**gqa_params, **{n: {"kernel": jnp.repeat(gqa_params[n]["kernel"], 2, axis=1)}
                                 for n in ("key", "value")}}
    assert_close(gqa.apply({"params": gqa_params}, x), mha.apply({"params": repeated}, x))


def test_multi_query_attention_runs():
    x = normal(4, (2, 6, 16))
    mqa = MultiHeadAttention(num_heads=4, num_kv_heads=1)
    params = init(mqa, x)
    assert params["key"]["kernel"].shape == (16, 1, 4)
    assert params["value"]["kernel"].shape == (16, 1, 4)
    out = mqa.apply({"params": params}, x, mask=causal_mask(6))
    assert out.shape == (2, 6, 16) and np.all(np.isfinite(out))


def test_additive_score_matches_float64_reference():
    x = normal(5, (2, 4, 8))
    mask = np.ones((2, 1, 4, 4), bool)
    mask[1, 0, :, 3] = False
    mha = MultiHeadAttention(num_heads=2, score_fn="additive", use_bias=True)
    params = init(mha, x)
    assert params["additive_v"].shape == (2, 4)
    got, weights = mha.apply({"params": params}, x, mask=jnp.asarray(mask), return_weights=True)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x64 = np.asarray(x, np.float64)
    q, k, v = (np.einsum("btd,dnh->btnh", x64, p[n]["kernel"]) + p[n]["bias"]
               for n in ("query", "key", "value"))
    scores = np.einsum("btsnh,nh->bnts", np.tanh(q[:, :, None] + k[:, None]), p["additive_v"])
    w = softmax(np.where(mask, scores, -np.inf), axis=-1)
    heads = np.einsum("bnts,bsnh->btnh", w, v)
    want = np.einsum("btnh,nhd->btd", heads, p["out"]["kernel"]) + p["out"]["bias"]
    np.testing.assert_allclose(weights, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position_encoding", ["none", "rope"])
def test_self_attention_permutation_equivariance(position_encoding):
    x = normal(6, (2, 6, 16))
    perm = np.array([3, 0, 5, 1, 4, 2])
    mha = MultiHeadAttention(num_heads=4, position_encoding=position_encoding)
    params = init(mha, x)
    out = np.asarray(mha.apply({"params": params}, x))
    out_perm = np.asarray(mha.apply({"params": params}, x[:, perm]))
    equivariant = np.allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-5)
    assert equivariant == (position_encoding == "none")


def _incremental(mha, params, x, prefill=0, mask=None):
    """Feeds x through the KV cache: `prefill` tokens in one call, then one by one."""
    _, init_vars = mha.apply({"params": params}, jnp.zeros_like(x), decode=True, mutable=["cache"])
    cache = init_vars["cache"]
    assert cache["cached_key"].shape[2] == x.shape[1]  # head-major [B, K, S, H]
    outs, t = [], 0
    for t_end in ([prefill] if prefill else []) + list(range(max(prefill, 0) + 1, x.shape[1] + 1)):
        out, new = mha.apply({"params": params, "cache": cache}, x[:, t:t_end], decode=True,
                             mask=mask, mutable=["cache"])
        cache, t = new["cache"], t_end
        outs.append(out)
    assert int(cache["cache_index"]) == x.shape[1]
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(position_encoding="rope"), dict(position_encoding="alibi"),
     dict(num_kv_heads=2), dict(score_fn="additive")],
    ids=["plain", "rope", "alibi", "gqa", "additive"],
)
def test_cached_decoding_equals_causal_forward(kwargs):
    x = normal(7, (2, 6, 16))
    mha = MultiHeadAttention(num_heads=4, use_bias=True, **kwargs)
    params = init(mha, x)
    full = mha.apply({"params": params}, x, mask=causal_mask(6))
    assert_close(_incremental(mha, params, x), full)
    if kwargs.get("position_encoding") == "rope":
        assert_close(_incremental(mha, params, x, prefill=3), full)


def test_cached_decoding_with_slot_mask_equals_masked_forward():
    x = normal(8, (2, 6, 16))
    valid = np.ones((2, 6), bool)
    valid[0, 1] = False  # a masked key slot, e.g. a left-padded prompt token
    slot_mask = jnp.asarray(valid)[:, None, None, :]
    mha = MultiHeadAttention(num_heads=4, position_encoding="rope")
    params = init(mha, x)
    full = mha.apply({"params": params}, x, mask=causal_mask(6) & slot_mask)
    inc = _incremental(mha, params, x, prefill=2, mask=slot_mask)
    assert_close(np.asarray(inc)[valid], np.asarray(full)[valid])


def test_cross_attention_caches_projected_keys():
    x = normal(9, (2, 4, 16))
    enc = normal(10, (2, 6, 16))
    mha = MultiHeadAttention(num_heads=4)
    params = init(mha, x, enc)
    full = mha.apply({"params": params}, x, enc)
    _, init_vars = mha.apply({"params": params}, x, enc, decode=True, mutable=["cache"])
    cache = init_vars["cache"]
    assert cache["cross_key"].shape == (2, 4, 6, 4)  # head-major [B, K, S, H]
    outs = []
    for t in range(4):
        # A different encoder output: only the cached projection may be used.
        out, new = mha.apply({"params": params, "cache": cache}, x[:, t : t + 1], enc * 0.0,
                             decode=True, mutable=["cache"])
        cache = new["cache"]
        outs.append(out)
    assert_close(jnp.concatenate(outs, 1), full)


def test_bad_attention_arguments_raise_value_errors():
    x = normal(11, (2, 6, 16))
    with pytest.raises(ValueError, match="d_model=16 is not divisible by num_heads=5"):
        init(MultiHeadAttention(num_heads=5), x)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        init(MultiHeadAttention(num_heads=4, num_kv_heads=3), x)
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        init(MultiHeadAttention(num_heads=2, head_dim=7, position_encoding="rope"), x)
    with pytest.raises(ValueError, match="score_fn='cosine' is unknown"):
        init(MultiHeadAttention(num_heads=4, score_fn="cosine"), x)
    mha = MultiHeadAttention(num_heads=4)
    params = init(mha, x)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 6, 4\)"):
        mha.apply({"params": params}, x, mask=jnp.ones((2, 1, 6, 4), bool))
    _, cache = mha.apply({"params": params}, x, decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match="decode mask has 3 key slots, the cache has 6"):
        mha.apply({"params": params, **cache}, x[:, :1], decode=True,
                  mask=jnp.ones((2, 1, 1, 3), bool), mutable=["cache"])

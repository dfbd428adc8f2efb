"""blockwise (flash) attention against the xla reference; hardware paths and auto."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_zoo.models import blockwise, blockwise_tiles, hardware_attention
from transformer_zoo.models.dot_product import (
    attention_scores,
    dot_product_attention,
    masked_softmax,
    weighted_values,
)
from transformer_zoo.models.dropout import keep_mask, keep_probability
from transformer_zoo.models.masks import make_attention_mask

# Small tiles so that short test sequences span several of them.
BQ, BK = 16, 8


def _qkv(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), dtype)
    v = jax.random.normal(ks[2], (B, S, K, H), dtype)
    return q, k, v


def _segments(B, L, seed):
    """[B, L] packed segment ids 1, 2, ... with trailing padding (0) on row 0."""
    rng = np.random.default_rng(seed)
    cut = sorted(rng.choice(np.arange(1, L), size=2, replace=False))
    row = np.concatenate([np.full(cut[0], 1), np.full(cut[1] - cut[0], 2), np.zeros(L - cut[1])])
    return jnp.asarray(np.stack([row] + [np.ones(L)] * (B - 1)), jnp.int32)


def _mask(kind, B, T, S):
    """Masks of several kinds for queries [B, T] and keys [B, S]."""
    if kind == "none":
        return None
    if kind == "causal":
        return make_attention_mask(None, q_len=T, kv_len=S, causal=True)
    if kind == "padding":
        kv_seg = jnp.asarray(np.arange(S)[None] < np.array([[S - 5]] * B), jnp.int32)
        return make_attention_mask(jnp.ones((B, T), jnp.int32), kv_seg)
    if kind == "segments_causal":
        return make_attention_mask(_segments(B, T, 1), causal=True)
    if kind == "window":
        return make_attention_mask(_segments(B, T, 2), causal=True, window=7)
    if kind == "window_bidirectional":
        return make_attention_mask(None, q_len=T, kv_len=S, window=9)
    if kind == "offset_causal":
        # Queries at positions 20.. (a chunk after a prefix), keys at 0..
        return make_attention_mask(None, q_positions=jnp.arange(20, 20 + T)[None],
                                   kv_len=S, causal=True)
    if kind == "dense_array":
        return jax.random.bernoulli(jax.random.PRNGKey(5), 0.7, (B, 1, T, S))
    if kind == "dense_extra":
        m = make_attention_mask(_segments(B, T, 3))
        return m.replace(dense=jax.random.bernoulli(jax.random.PRNGKey(6), 0.7, (1, 1, T, S)))
    raise ValueError(kind)


def _loss_and_grads(impl_fn, q, k, v, slopes):
    def loss(q, k, v, slopes):
        out = impl_fn(q, k, v, slopes)
        # A non-trivial cotangent: sum(out**2) would weight rows alike.
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))), out

    argnums = (0, 1, 2) if slopes is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, slopes)
    return out, grads


def _compare(mask, q, k, v, slopes, rtol, atol, bq=BQ, bk=BK):
    ref = _loss_and_grads(
        lambda q, k, v, s: dot_product_attention(q, k, v, mask=mask, alibi_slopes=s), q, k, v,
        slopes)
    got = _loss_and_grads(
        lambda q, k, v, s: blockwise.blockwise_attention(
            q, k, v, mask=mask, alibi_slopes=s, block_q=bq, block_kv=bk), q, k, v, slopes)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32),
                               rtol=rtol, atol=atol)
    for n, (g, r) in enumerate(zip(got[1], ref[1], strict=True)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        # The slopes' gradient sums B * T * S terms that cancel (one entry is
        # ~0.08 among entries of ~15): its rounding is relative to the largest.
        tol = max(atol, rtol * np.abs(r).max()) if n == 3 else atol
        np.testing.assert_allclose(g, r, rtol=rtol, atol=tol)


CASES = [
    # kind, B, T, S, N, K, H, alibi
    ("none", 2, 37, 37, 4, 4, 8, False),
    ("causal", 1, 50, 50, 4, 2, 16, False),
    ("causal", 1, 64, 64, 4, 2, 16, False),  # tiles divide S: no segment ids compared
    ("causal", 2, 29, 45, 2, 1, 8, True),
    ("padding", 2, 33, 41, 4, 2, 8, False),
    ("segments_causal", 2, 40, 40, 6, 3, 8, True),
    ("window", 1, 47, 47, 2, 2, 8, True),
    ("dense_array", 2, 24, 30, 2, 1, 8, False),
    ("dense_extra", 1, 35, 35, 4, 2, 8, True),
    ("window_bidirectional", 2, 43, 43, 4, 2, 8, True),
    ("offset_causal", 1, 30, 50, 4, 1, 8, False),
]


# Small tiles (the online softmax over several tiles) and the default ones, which
# hold each case in one tile (plain autodiff).
TILINGS = pytest.mark.parametrize("bq,bk", [(BQ, BK), (blockwise.DEFAULT_BLOCK_Q,
                                                       blockwise.DEFAULT_BLOCK_KV)],
                                  ids=["tiles", "one_tile"])


@TILINGS
@pytest.mark.parametrize("kind,B,T,S,N,K,H,alibi", CASES)
def test_blockwise_matches_xla_fp32(kind, B, T, S, N, K, H, alibi, bq, bk):
    q, k, v = _qkv(B, T, S, N, K, H, seed=T)
    slopes = jnp.linspace(0.05, 0.5, N) if alibi else None
    _compare(_mask(kind, B, T, S), q, k, v, slopes, rtol=1e-5, atol=2e-6, bq=bq, bk=bk)


@pytest.mark.parametrize("kind", ["causal", "segments_causal"])
def test_blockwise_bf16_close_to_fp32_reference(kind):
    # bf16 keeps ~3 digits, so both implementations are judged against the
    # float32 reference on the same (bf16-rounded) inputs.
    q, k, v = _qkv(2, 40, 40, 4, 2, 16, jnp.bfloat16, seed=7)
    mask, slopes = _mask(kind, 2, 40, 40), jnp.linspace(0.1, 0.4, 4)
    ref = _loss_and_grads(
        lambda q, k, v, s: dot_product_attention(q, k, v, mask=mask, alibi_slopes=s),
        *(x.astype(jnp.float32) for x in (q, k, v)), slopes)
    got = _loss_and_grads(
        lambda q, k, v, s: blockwise.blockwise_attention(
            q, k, v, mask=mask, alibi_slopes=s, block_q=BQ, block_kv=BK), q, k, v, slopes)
    assert got[0].dtype == jnp.bfloat16
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=1e-2, atol=1e-2)


def test_blockwise_one_tile_and_default_blocks_match_xla():
    q, k, v = _qkv(1, 300, 300, 2, 2, 8, seed=3)
    mask = make_attention_mask(None, q_len=300, causal=True)
    _compare(mask, q, k, v, None, rtol=1e-5, atol=2e-6, bq=blockwise.DEFAULT_BLOCK_Q,
             bk=blockwise.DEFAULT_BLOCK_KV)


def _float64_reference(q, k, v, slopes, visible):
    """Output and gradients of sum(out * cos(out)) in float64 numpy, by hand.

    q [B, T, N, H], k/v [B, S, K, H], slopes [N], visible [B, 1, T, S].
    """
    q, k, v, slopes = (np.asarray(x, np.float64) for x in (q, k, v, slopes))
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # query head n uses key head n // G
    dist = np.abs(np.arange(q.shape[1])[:, None] - np.arange(k.shape[1])[None])
    scale = q.shape[-1] ** -0.5
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale - slopes[:, None, None] * dist
    s = np.where(visible, s, -np.inf)
    # Rows that see no key (padding) have zero weights and output.
    p = np.where(visible, np.exp(s - np.where(visible, s, -1e300).max(-1, keepdims=True)), 0.0)
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    d_out = np.cos(out) - out * np.sin(out)
    dp = np.einsum("btnh,bsnh->bnts", d_out, v)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
    dq = np.einsum("bnts,bsnh->btnh", ds, k) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    dv = np.einsum("bnts,btnh->bsnh", p, d_out)

    def per_key_head(x):
        return x.reshape(x.shape[:2] + (-1, G) + x.shape[3:]).sum(3)

    return out, (dq, per_key_head(dk), per_key_head(dv), -np.einsum("bnts,ts->n", ds, dist))


def test_default_blocks_across_tiles_match_float64():
    # Three 512-query tiles (the last one padded), GQA, packed causal segments, ALiBi.
    # Judged against float64: the slopes' gradient sums ~10^6 terms, where a
    # float32 reference is itself ~2e-5 off.
    q, k, v = _qkv(1, 1100, 1100, 4, 2, 8, seed=4)
    mask = make_attention_mask(_segments(1, 1100, 9), causal=True)
    slopes = jnp.linspace(0.05, 0.3, 4)
    got = _loss_and_grads(lambda q, k, v, s: blockwise.blockwise_attention(
        q, k, v, mask=mask, alibi_slopes=s), q, k, v, slopes)
    ref = _float64_reference(q, k, v, slopes, np.asarray(mask.dense_mask()))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kind,T,S", [
    ("causal", 64, 64), ("causal", 40, 72), ("padding", 33, 41), ("segments_causal", 64, 64),
    ("window", 64, 64), ("window_bidirectional", 64, 64), ("offset_causal", 30, 50),
    ("dense_extra", 35, 35)])
def test_tile_classes_never_skip_a_visible_key_nor_unmask_a_hidden_one(kind, T, S):
    B, N, K = 2, 4, 2
    mask = blockwise._as_attention_mask(_mask(kind, B, T, S), T, S)
    cfg = blockwise_tiles.TileConfig(batch=B, kv_heads=K, groups=N // K, block_q=BQ,
                                     block_kv=BK, dropout_rate=0.0, causal=mask.causal,
                                     window=mask.window, has_mask=True)
    blocks = blockwise._mask_blocks(mask, T, S, N, BQ, BK)
    classes = np.asarray(blockwise_tiles.tile_classes(cfg, blocks))
    nq, nk = -(-T // BQ), -(-S // BK)
    assert classes.shape == (nq, nk)
    exact = np.zeros((nq, nk), int)
    corner_hidden = np.zeros((nq, nk), bool)  # first half of queries x second half of keys
    nested_hidden = np.zeros((nq, nk), bool)  # first quarter of queries x second quarter
    for i in range(nq):
        for j in range(nk):
            tile = np.asarray(blockwise_tiles._tile_mask(cfg, blocks, i, j,
                                                         blockwise_tiles._full(cfg)))
            exact[i, j] = 2 if tile.all() else int(tile.any())
            corner_hidden[i, j] = not tile[..., :BQ // 2, BK // 2:].any()
            nested_hidden[i, j] = not tile[..., :BQ // 4, BK // 4:BK // 2].any()
    # HIDDEN, VISIBLE and the corners a CORNER or NESTED tile skips are certain;
    # PARTIAL, CORNER and NESTED may stand for more (they mask exactly).
    nested = classes == blockwise_tiles.NESTED
    split = (classes == blockwise_tiles.CORNER) | nested
    assert np.all(exact[classes == blockwise_tiles.HIDDEN] == blockwise_tiles.HIDDEN)
    assert np.all(exact[classes == blockwise_tiles.VISIBLE] == blockwise_tiles.VISIBLE)
    assert np.all(corner_hidden[split])
    assert np.all(nested_hidden[nested])
    if kind == "causal" and T == S:
        # Aligned tiles under a causal mask: exact; a tile is skipped when its
        # first key comes after its last query, split when its second half of
        # keys comes after its first half of queries, and split again when its
        # second quarter of keys comes after its first quarter of queries.
        np.testing.assert_array_equal(np.where(split, blockwise_tiles.PARTIAL, classes), exact)
        np.testing.assert_array_equal(split, (exact == blockwise_tiles.PARTIAL) & corner_hidden)
        np.testing.assert_array_equal(nested, split & nested_hidden)
        i, j = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
        np.testing.assert_array_equal(classes == blockwise_tiles.HIDDEN, j * BK > (i + 1) * BQ - 1)
        assert nested.any()
    else:
        # Not uselessly conservative: some tile is skipped or left unmasked.
        partial = blockwise_tiles.PARTIAL
        assert (classes != partial).any() or (exact == partial).all()


@TILINGS
def test_fully_masked_rows_are_zero_with_finite_grads(bq, bk):
    B, T, N, H = 1, 30, 2, 8
    q, k, v = _qkv(B, T, T, N, N, H)
    seg = jnp.asarray([[1] * 20 + [0] * 10], jnp.int32)  # the last 10 queries see nothing
    mask = make_attention_mask(seg, causal=True)
    out, grads = _loss_and_grads(
        lambda q, k, v, s: blockwise.blockwise_attention(q, k, v, mask=mask, block_q=bq,
                                                         block_kv=bk), q, k, v, None)
    np.testing.assert_array_equal(np.asarray(out[:, 20:]), 0.0)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    np.testing.assert_array_equal(np.asarray(grads[0][:, 20:]), 0.0)


def test_causal_skips_future_key_tiles():
    # Keys 32.. are in the future of every query: their tiles must never be
    # touched, so NaN values there cannot leak (0 * NaN would if computed).
    B, T, S, N, H = 1, 32, 64, 2, 8
    q, k, v = _qkv(B, T, S, N, N, H)
    v_nan = v.at[:, T:].set(jnp.nan)
    mask = make_attention_mask(None, q_len=T, kv_len=S, causal=True)

    def attend(v):
        return blockwise.blockwise_attention(q, k, v, mask=mask, block_q=BQ, block_kv=16)

    out, vjp = jax.vjp(jax.jit(attend), v_nan)
    ref = dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
    assert bool(jnp.all(jnp.isfinite(vjp(jnp.ones_like(out))[0][:, :T])))


def _dense_keep(rate, rng, B, N, T, S, K, bq=BQ, bk=BK):
    """The [B, N, T, S] keep mask blockwise draws, assembled tile by tile."""
    G, bq, bk = N // K, min(bq, T), min(bk, S)  # tiles no longer than the sequence
    rows = []
    for i in range(-(-T // bq)):
        tiles = []
        for j in range(-(-S // bk)):
            keep = keep_mask(jax.random.fold_in(jax.random.fold_in(rng, i), j), rate,
                             (B, K, G, bq, bk))
            tiles.append(keep.reshape(B, N, bq, bk))
        rows.append(jnp.concatenate(tiles, axis=-1))
    return jnp.concatenate(rows, axis=-2)[:, :, :T, :S]


@TILINGS
def test_dropout_matches_dense_reference_with_same_keep_mask(bq, bk):
    B, T, N, K, H, rate = 2, 27, 4, 2, 8, 0.3
    q, k, v = _qkv(B, T, T, N, K, H)
    rng = jax.random.PRNGKey(11)
    mask = make_attention_mask(_segments(B, T, 4), causal=True)
    keep = _dense_keep(rate, rng, B, N, T, T, K, bq, bk)

    def reference(q, k, v):
        w = masked_softmax(attention_scores(q, k, H**-0.5), mask.dense_mask())
        return weighted_values(jnp.where(keep, w / keep_probability(rate), 0.0), v, q.dtype)

    def ours(q, k, v):
        return blockwise.blockwise_attention(q, k, v, mask=mask, dropout_rate=rate,
                                             dropout_rng=rng, block_q=bq, block_kv=bk)

    got = _loss_and_grads(lambda q, k, v, s: ours(q, k, v), q, k, v, None)
    ref = _loss_and_grads(lambda q, k, v, s: reference(q, k, v), q, k, v, None)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
    # And dropout does something.
    no_drop = dot_product_attention(q, k, v, mask=mask)
    assert float(jnp.max(jnp.abs(got[0] - no_drop))) > 1e-2


def _all_avals(jaxpr):
    """Every variable's abstract value in a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _all_avals(inner)


def _largest_intermediate(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return max(int(np.prod(a.shape)) for a in _all_avals(jaxpr) if hasattr(a, "shape"))


def test_backward_stores_no_t_by_s_matrix():
    T = S = 1024
    N, H = 2, 16
    q, k, v = _qkv(1, T, S, N, N, H)
    mask = make_attention_mask(None, q_len=T, causal=True)

    def grad_of(impl_fn):
        return jax.grad(lambda q, k, v: jnp.sum(impl_fn(q, k, v) ** 2), (0, 1, 2))

    ours = grad_of(lambda q, k, v: blockwise.blockwise_attention(q, k, v, mask=mask, block_q=128,
                                                                 block_kv=128))
    ref = grad_of(lambda q, k, v: dot_product_attention(q, k, v, mask=mask))
    # The checker sees the reference's [T, S] scores ...
    assert _largest_intermediate(ref, q, k, v) >= T * S
    # ... and blockwise never has anything bigger than the inputs or a tile.
    assert _largest_intermediate(ours, q, k, v) <= max(T * N * H, N * 128 * 128)
    ours_mem = jax.jit(ours).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    ref_mem = jax.jit(ref).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    assert ours_mem * 8 < ref_mem


def test_blockwise_impl_refuses_weights_and_bias():
    q, k, v = _qkv(1, 8, 8, 2, 2, 4)
    with pytest.raises(ValueError, match="return_weights"):
        dot_product_attention(q, k, v, impl="blockwise", return_weights=True)
    with pytest.raises(ValueError, match="bias"):
        dot_product_attention(q, k, v, impl="blockwise", bias=jnp.zeros((1, 1, 8, 8)))


def test_registered_blockwise_matches_xla():
    q, k, v = _qkv(2, 20, 20, 4, 2, 8)
    mask = make_attention_mask(_segments(2, 20, 9), causal=True)
    ref = dot_product_attention(q, k, v, mask=mask)
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="blockwise"))(
        q, k, v)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)


# --- hardware paths and auto -------------------------------------------------


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks a host without cuDNN")
def test_cudnn_refuses_where_cudnn_is_absent():
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(1, 8, 8, 2, 2, 4))
    with pytest.raises(ValueError, match="attention_impl='cudnn' cannot run here: cuDNN"):
        dot_product_attention(q, k, v, impl="cudnn")


def test_pallas_compiled_for_cpu_runs_the_interpreter_and_matches_xla():
    q, k, v = _qkv(1, 8, 8, 2, 2, 4)
    mask = make_attention_mask(None, q_len=8, causal=True)
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="pallas"))(
        q, k, v)
    np.testing.assert_allclose(got, dot_product_attention(q, k, v, mask=mask), rtol=1e-5,
                               atol=2e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU choice")
def test_auto_picks_xla_short_and_blockwise_long_on_cpu(caplog, monkeypatch):
    monkeypatch.setattr(hardware_attention, "_logged", set())  # earlier tests' choices
    caplog.set_level(logging.INFO, logger="transformer_zoo.models.hardware_attention")
    short = _qkv(1, 16, 16, 2, 2, 4)
    long_len = hardware_attention.AUTO_LONG_SEQUENCE
    long = _qkv(1, 4, long_len, 2, 2, 4)
    mask = make_attention_mask(None, q_len=4, kv_len=long_len)
    for (q, k, v), m, expected in [(short, None, "xla"), (long, mask, "blockwise")]:
        call = dict(mask=m, bias=None, alibi_slopes=None, scale=0.5, dropout_rate=0.0,
                    dropout_rng=None, return_weights=False)
        assert hardware_attention.choose_impl(q, k, v, "cpu", **call)[0] == expected
        got = jax.jit(lambda q, k, v, m=m: dot_product_attention(q, k, v, mask=m, impl="auto"))(
            q, k, v)
        np.testing.assert_allclose(got, dot_product_attention(q, k, v, mask=m), rtol=1e-5,
                                   atol=2e-6)
    text = caplog.text
    assert "runs 'xla'" in text and "runs 'blockwise'" in text
    # Logged once per choice, not once per call.
    dot_product_attention(*short, impl="auto")
    assert caplog.text.count("runs 'xla'") == 1


def test_auto_uses_xla_when_weights_are_requested():
    q, k, v = _qkv(1, 4, hardware_attention.AUTO_LONG_SEQUENCE, 2, 2, 4)
    out, weights = dot_product_attention(q, k, v, impl="auto", return_weights=True)
    assert weights.shape == (1, 2, 4, hardware_attention.AUTO_LONG_SEQUENCE)


@pytest.mark.parametrize("causal", [False, True])
def test_pallas_gpu_adapter_in_interpreter_matches_xla(causal):
    # The GPU kernel's Pallas interpreter runs on CPU: checks the adapter's
    # GQA repeat, length padding and segment handling.
    B, T, N, K, H = 2, 37, 4, 2, 16
    q, k, v = _qkv(B, T, T, N, K, H)
    mask = make_attention_mask(_segments(B, T, 8), causal=causal)
    got = hardware_attention._pallas_attention(
        q, k, v, mask=mask, bias=None, alibi_slopes=None, scale=H**-0.5, dropout_rate=0.0,
        dropout_rng=None, return_weights=False, interpret=True)
    np.testing.assert_allclose(got, dot_product_attention(q, k, v, mask=mask), rtol=1e-5,
                               atol=2e-6)



@pytest.mark.slow
def test_decoder_only_trains_the_same_with_blockwise():
    import optax

    from transformer_zoo.models import DecoderOnly, ModelConfig
    from transformer_zoo.models.dot_product import register_attention_impl

    # Small tiles so the 40-token sequences span several of them.
    register_attention_impl("blockwise_test_tiles", blockwise.make_blockwise_impl(16, 8))
    rng = np.random.default_rng(0)
    targets = rng.integers(3, 32, size=(2, 40))
    targets[1, 30:] = 0  # padding
    targets = jnp.asarray(targets, jnp.int32)

    def losses(impl):
        cfg = ModelConfig(vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                          num_decoder_layers=2, dropout_rate=0.0, norm_position="pre",
                          position_encoding="alibi", attention_impl=impl)
        model = DecoderOnly(cfg)
        params = model.init(jax.random.PRNGKey(0), targets)
        opt = optax.adam(1e-2)
        state = opt.init(params)

        def loss_fn(p):
            logits = model.apply(p, targets)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return jnp.sum(ce * (targets != 0)) / jnp.sum(targets != 0)

        @jax.jit
        def step(p, s):
            loss, g = jax.value_and_grad(loss_fn)(p)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, loss

        out = []
        for _ in range(3):
            params, state, loss = step(params, state)
            out.append(float(loss))
        return np.array(out)

    ref, got = losses("xla"), losses("blockwise_test_tiles")
    assert ref[-1] < ref[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_vmap_over_masks_with_different_visible_tiles():
    # Each vmapped element skips different tiles (its loops' trip counts are
    # batched): queries at offsets 0, 17, 33 against keys at 20.., so some rows
    # see no key at all and some tiles are hidden in one element only.
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (3, 1, 40, 2, 8)) for key in ks)
    offsets = jnp.array([0, 17, 33])

    def attend(impl):
        def one(q, k, v, offset):
            mask = make_attention_mask(None, q_positions=(jnp.arange(40) + offset)[None],
                                       kv_positions=jnp.arange(40)[None] + 20, causal=True)
            return impl(q, k, v, mask)
        return lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(one)(q, k, v, offsets)))

    ours = attend(lambda q, k, v, m: blockwise.blockwise_attention(q, k, v, mask=m, block_q=BQ,
                                                                    block_kv=BK))
    ref = attend(lambda q, k, v, m: dot_product_attention(q, k, v, mask=m))
    got, want = (jax.value_and_grad(f, (0, 1, 2))(q, k, v) for f in (ours, ref))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)

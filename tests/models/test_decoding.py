"""Decoding: KV-cached search against full recomputation, beam search against
exhaustive search, sampling filters, EOS handling and per-beam cache tiling."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_zoo import models
from transformer_zoo.models import decoding
from transformer_zoo.models import generate as gen

EOS, PAD, BOS = 1, 0, 2

# Pre-norm with an untied head: random tiny models then produce varied tokens
# instead of copying their input, so a wrong cache changes the argmax. Every
# positional scheme; full multi-head, grouped-query (K=2 of N=4) and multi-query.
SCHEMES = [("sinusoidal", None), ("learned", 2), ("rope", 2), ("alibi", 1)]


def _config(position_encoding="sinusoidal", num_kv_heads=None, **kw):
    # One layer each keeps compile times down (the decoder step compiles to
    # ~55 fusions per layer); the exhaustive beam test uses two decoder layers,
    # so that a layer's cache holds keys computed from the previous layer's output.
    kw = {"dropout_rate": 0.0, "tie_output": False, "norm_position": "pre",
          "num_encoder_layers": 1, "num_decoder_layers": 1, **kw}
    return models.get_preset("tiny", position_encoding=position_encoding,
                             num_kv_heads=num_kv_heads, **kw)


SOURCES = jnp.array([[5, 6, 7, 8, 9, 0, 0, 0], [9, 10, 11, 12, 13, 14, 15, 16]])
PROMPTS = jnp.array([[5, 6, 7, 0, 0, 0], [9, 10, 11, 12, 13, 14], [0, 0, 0, 0, 0, 0]])


def _random_params(model, *init_args, seed=1):
    """Parameters drawn with numpy for the shapes `model.init` would create.

    Drawing them outside JAX avoids compiling the initialisers of every test
    model (most of this file's time on 2 CPU cores otherwise). Norm scales
    near 1, other weights N(0, 1 / fan_in); seed 1 gives every test model
    varied greedy outputs (see `_assert_varied`).
    """
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *init_args))["params"]
    rng = np.random.default_rng(seed)
    d_model = model.config.d_model

    def draw(path, leaf):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
        # Attention output kernels are [N, H, D]: their fan-in is N * H.
        out_kernel = leaf.ndim == 3 and leaf.shape[-1] == d_model
        fan_in = leaf.shape[0] * (leaf.shape[1] if out_kernel else 1)
        return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan_in), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def _encdec(**kw):
    model = models.EncoderDecoder(_config(**kw))
    return model, _random_params(model, SOURCES, SOURCES)


def _deconly(**kw):
    model = models.DecoderOnly(_config(**kw))
    return model, _random_params(model, PROMPTS)


def _assert_varied(out):
    """A model that repeats one token would hide cache errors: demand variety."""
    assert len(np.unique(out)) >= 5 and all(len(np.unique(r)) >= 2 for r in out), out


# On 2 CPU cores compilation is most of this file's time. So each check runs
# as one jitted program (op-by-op reference forwards would compile every
# primitive separately), compiled without LLVM's optimisation passes (about 4x
# faster to compile; the same HLO, only slower machine code).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _fast_jit(fn, **kw):
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kw)


@functools.partial(_fast_jit, static_argnums=0)
def _greedy_and_reference_encdec(model, params):
    """Cached greedy [B, L] and the argmax [B, L] of the teacher-forced forward (no cache)."""
    out = gen.translate_greedy(model, params, SOURCES, max_extra=4, eos_id=-1)
    # Every target counts as a token (a generated PAD id too); causality hides the future.
    logits = model.apply({"params": params}, SOURCES, out, targets_segmentation=jnp.ones_like(out))
    return out, jnp.argmax(logits, -1)


@functools.partial(_fast_jit, static_argnums=0)
def _greedy_and_reference_deconly(model, params):
    """Cached greedy [B, N] after left-padded prompts, and the argmax of the full
    forward over each row's prompt + output laid out from position 0."""
    out = gen.generate(model, params, PROMPTS, max_new_tokens=8, greedy=True, eos_id=-1)
    B, P = PROMPTS.shape
    N = out.shape[1]
    n = jnp.sum(PROMPTS != PAD, axis=1)[:, None]
    cols = jnp.arange(P + N)[None]
    src = jnp.where(cols < n, cols, P + cols - n)
    seqs = jnp.take_along_axis(jnp.concatenate([PROMPTS, out], 1), jnp.minimum(src, P + N - 1), 1)
    logits = model.apply({"params": params}, seqs, (cols < n + N).astype(jnp.int32))
    expected = jnp.take_along_axis(jnp.argmax(logits, -1), n + jnp.arange(N)[None], 1)
    return out, expected


@pytest.mark.parametrize("position_encoding,num_kv_heads", SCHEMES)
def test_cached_greedy_equals_full_recompute_encoder_decoder(position_encoding, num_kv_heads):
    """Also checks the per-sentence limit: source length + max_extra, PAD after."""
    model, params = _encdec(position_encoding=position_encoding, num_kv_heads=num_kv_heads)
    out, expected = map(np.asarray, _greedy_and_reference_encdec(model, params))
    _assert_varied(out)
    limits = np.asarray((SOURCES != PAD).sum(1)) + 4
    for b, limit in enumerate(limits):
        np.testing.assert_array_equal(out[b, :limit], expected[b, :limit])
        assert (out[b, limit:] == PAD).all()


@pytest.mark.parametrize("position_encoding,num_kv_heads", SCHEMES)
def test_cached_greedy_equals_full_recompute_decoder_only(position_encoding, num_kv_heads):
    """Prompts of different lengths (one empty) share a batch through left padding."""
    model, params = _deconly(position_encoding=position_encoding, num_kv_heads=num_kv_heads)
    out, expected = map(np.asarray, _greedy_and_reference_deconly(model, params))
    _assert_varied(out)
    np.testing.assert_array_equal(out, expected)


def test_recompute_path_equals_cached_path():
    """The benchmark's no-cache reference decodes the same tokens."""
    model, params = _encdec(position_encoding="rope", num_kv_heads=2)
    cached, _ = _greedy_and_reference_encdec(model, params)
    recomputed = _fast_jit(lambda p: gen.translate_greedy(
        model, p, SOURCES, max_extra=4, eos_id=-1, use_cache=False))(params)
    np.testing.assert_array_equal(cached, recomputed)
    lm, lm_params = _deconly(position_encoding="alibi", num_kv_heads=1)
    cached, _ = _greedy_and_reference_deconly(lm, lm_params)
    recomputed = _fast_jit(lambda p: gen.generate(
        lm, p, PROMPTS, max_new_tokens=8, greedy=True, eos_id=-1, use_cache=False))(lm_params)
    np.testing.assert_array_equal(cached, recomputed)


# ------------------------------------------------------------------ exhaustive beam search


def _all_hypotheses(vocab, max_len):
    """Every output: EOS after n < max_len non-EOS tokens, or max_len non-EOS tokens."""
    others = [v for v in range(vocab) if v != EOS]
    seqs = []
    for n in range(max_len):
        seqs += [list(p) + [EOS] + [PAD] * (max_len - n - 1)
                 for p in itertools.product(others, repeat=n)]
    seqs += [list(p) for p in itertools.product(others, repeat=max_len)]
    lengths = [s.index(EOS) + 1 if EOS in s else max_len for s in seqs]
    return np.array(seqs), np.array(lengths)


def _exhaustive_scores(model, params, sources, seqs, lengths, alpha):
    """log P(Y|X) / lp(|Y|) [B, n] of every hypothesis for every source, one forward."""
    B, (n, L) = sources.shape[0], seqs.shape
    logits = _fast_jit(model.apply)({"params": params}, jnp.repeat(sources, n, axis=0),
                                    jnp.asarray(np.tile(seqs, (B, 1))),
                                    targets_segmentation=jnp.ones((B * n, L), jnp.int32))
    logp = np.asarray(jax.nn.log_softmax(logits)).reshape(B, n, L, -1)
    tokens = np.broadcast_to(seqs[None, ..., None], (B, n, L, 1))
    logp = np.take_along_axis(logp, tokens, -1)[..., 0]
    logp = (logp * (np.arange(L)[None, None] < lengths[None, :, None])).sum(-1)
    return logp / ((5.0 + lengths[None]) / 6.0) ** alpha


def test_large_beam_finds_best_length_penalised_hypothesis():
    vocab, max_len, alpha = 5, 4, 0.6
    model = models.EncoderDecoder(_config(vocab_size=vocab, num_decoder_layers=2))
    sources = jnp.array([[3, 4], [4, 3]])
    params = _random_params(model, sources, sources)
    # Beam 64 keeps all 4^3 live prefixes, so the search is exact.
    seqs, scores = _fast_jit(lambda p: gen.translate_beams(
        model, p, sources, beam_size=64, alpha=alpha, max_extra=max_len - 2))(params)
    hyps, lengths = _all_hypotheses(vocab, max_len)
    refs = _exhaustive_scores(model, params, sources, hyps, lengths, alpha)
    for b, ref in enumerate(refs):
        order = np.argsort(-ref)[:10]
        np.testing.assert_array_equal(np.asarray(seqs[b, :10]), hyps[order])
        np.testing.assert_allclose(np.asarray(scores[b, :10]), ref[order], rtol=1e-5, atol=1e-5)


def test_beam_search_per_row_equals_row_alone():
    """Tiling/gathering the cache per beam keeps the rows of a batch independent."""
    model, params = _encdec(position_encoding="rope", num_kv_heads=2)
    kw = dict(beam_size=4, alpha=0.6, max_extra=5)
    beams = _fast_jit(lambda p, x: gen.translate_beams(model, p, x, **kw))
    seqs, scores = beams(params, SOURCES)
    for b in range(SOURCES.shape[0]):
        alone, alone_scores = beams(params, SOURCES[b : b + 1])
        np.testing.assert_array_equal(seqs[b], alone[0])
        np.testing.assert_allclose(scores[b], alone_scores[0], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(seqs[0], seqs[1])


def test_per_source_leaves_are_not_reordered_and_beams_unchanged():
    """Skipping the reorder of encoder output and cross K/V (the same for every
    beam of a row) gives the beams of a search that reorders every leaf."""
    model, params = _encdec(num_decoder_layers=2)
    max_len = SOURCES.shape[1] + 5

    def search(p, per_source):
        step, state, first = gen.prepare_translation(model, p, SOURCES, max_len)
        return decoding.beam_search(step, state, first, max_len, beam_size=4,
                                    per_source=per_source)

    fast = _fast_jit(lambda p: search(p, gen.per_source_leaf))(params)
    full = _fast_jit(lambda p: search(p, None))(params)
    np.testing.assert_array_equal(fast[0], full[0])
    np.testing.assert_allclose(fast[1], full[1], rtol=1e-6)
    _assert_varied(np.asarray(fast[0][:, 0]))
    _, state, _ = gen.prepare_translation(model, params, SOURCES, max_len)
    marked = {jax.tree_util.keystr(path).split("'")[-2]
              for path, _ in jax.tree_util.tree_leaves_with_path(state)
              if gen.per_source_leaf(path)}
    assert marked == {"encoded", "src_seg", "cross_key", "cross_value"}


# ------------------------------------------------------------ fake models: EOS and sampling


def _scripted(vocab, eos_at):
    """Step function preferring token 3 + (t + row) % (V - 3), and EOS at step eos_at[row].

    After its EOS step a row prefers non-EOS tokens again, so only the search
    can keep a finished row finished. The state is per row (tiled per beam)
    plus a scalar counter (shared, so beam search must not tile it).
    """
    eos_at = jnp.asarray(eos_at)

    def step(ids, state):
        t, row = state["t"], state["row"]
        logits = 5.0 * jax.nn.one_hot(3 + (t + row) % (vocab - 3), vocab)
        logits = jnp.where((t == eos_at[row])[:, None], 10.0 * jax.nn.one_hot(EOS, vocab), logits)
        return logits[:, None], {"t": t + 1, "row": row, "calls": state["calls"] + 1}

    B = eos_at.shape[0]
    state = {"t": jnp.zeros(B, jnp.int32), "row": jnp.arange(B), "calls": jnp.zeros((), jnp.int32)}
    return step, state, jnp.full((B,), BOS, jnp.int32)


def _scripted_expected(vocab, eos_at, max_len):
    out = np.zeros((len(eos_at), max_len), np.int32)
    for b, e in enumerate(eos_at):
        for t in range(min(e, max_len)):
            out[b, t] = 3 + (t + b) % (vocab - 3)
        if e < max_len:
            out[b, e] = EOS
    return out


def _assert_pad_after_eos(seqs):
    for row in np.asarray(seqs).reshape(-1, seqs.shape[-1]):
        hits = np.flatnonzero(row == EOS)
        if hits.size:
            assert (row[hits[0] + 1 :] == PAD).all(), row


def test_eos_rows_stay_finished_and_padded():
    vocab, eos_at, max_len = 8, [2, 5, 20], 10
    expected = _scripted_expected(vocab, eos_at, max_len)
    step, state, first = _scripted(vocab, eos_at)

    @_fast_jit
    def run():
        key = jax.random.PRNGKey(0)
        return (decoding.greedy_search(step, state, first, max_len),
                decoding.sample(step, state, first, max_len, key, top_k=1),
                decoding.beam_search(step, state, first, max_len, beam_size=3)[0],
                decoding.sample(step, state, first, max_len, key, temperature=3.0))

    greedy, top1, beams, hot = run()
    np.testing.assert_array_equal(greedy, expected)
    np.testing.assert_array_equal(top1, expected)
    np.testing.assert_array_equal(beams[:, 0], expected)
    for seqs in (beams, hot):
        _assert_pad_after_eos(seqs)


def test_beam_size_one_equals_greedy():
    """With EOS (alpha = 0: a longer beam cannot overtake a finished one) and
    without EOS (then any alpha: one live beam, always the argmax)."""
    step, state, first = _scripted(8, [2, 5, 20])

    @_fast_jit
    def run():
        greedy = decoding.greedy_search(step, state, first, 10)
        beam, _ = decoding.beam_search(step, state, first, 10, beam_size=1, alpha=0.0)
        greedy_no_eos = decoding.greedy_search(step, state, first, 10, eos_id=-1)
        beam_no_eos, _ = decoding.beam_search(step, state, first, 10, beam_size=1, eos_id=-1)
        return greedy, beam[:, 0], greedy_no_eos, beam_no_eos[:, 0]

    greedy, beam, greedy_no_eos, beam_no_eos = run()
    np.testing.assert_array_equal(beam, greedy)
    np.testing.assert_array_equal(beam_no_eos, greedy_no_eos)
    assert (greedy == EOS).any() and not (greedy_no_eos == EOS).all()


def test_beam_search_stops_early_when_no_live_beam_can_win():
    """EOS is ~certain at every step: after a few steps the 4 finished beams beat
    any bound a live beam can reach, long before max_len = 50."""
    calls = []

    def step(ids, state):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.tile(10.0 * jax.nn.one_hot(EOS, 5), (ids.shape[0], 1)), state

    first = jnp.full((2,), BOS)
    seqs, scores = _fast_jit(lambda: decoding.beam_search(step, {}, first, 50, beam_size=4))()
    jax.effects_barrier()
    np.testing.assert_array_equal(seqs[:, 0, :2], [[EOS, PAD], [EOS, PAD]])
    # Hand count: live log-probs fall by ~10 per step while lp(50) ~ 3.78, so the
    # bound -10 t / 3.78 drops below the 4th finished score (-10 / lp(2)) at t = 4.
    assert len(calls) == 4, len(calls)
    assert scores[0, 0] > scores[0, 1] > decoding.NEG_INF / 2


def test_first_argmax_equals_argmax_with_ties_nans_and_infinities():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 50)).astype(np.float32)
    x[:, 7] = x.max(1)  # every row ties at least once: the first maximum wins
    x[::3, 20] = x[::3].max(1)
    x[::5, 2] = x[::5].max(1)
    x[5, 3] = np.nan  # argmax returns the first NaN
    x[9, [40, 4]] = np.nan
    x[11, :] = -np.inf
    x[12, 30] = np.inf
    x[13, 1:3] = np.inf
    for arr in (jnp.asarray(x), jnp.asarray(x, jnp.bfloat16), jnp.asarray(x).reshape(8, 50, 50)):
        want = np.asarray(jnp.argmax(arr, axis=-1))
        got = jax.jit(decoding.first_argmax)(arr)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(decoding.first_argmax(arr)), want)
    ints = jnp.asarray(rng.integers(0, 5, (20, 9)))  # integer scores fall back to argmax
    np.testing.assert_array_equal(decoding.first_argmax(ints), jnp.argmax(ints, -1))


def test_filter_logits_keeps_top_k_and_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: np.isfinite(np.asarray(decoding.filter_logits(logits, **kw)))[0].tolist()
    assert kept(top_k=3) == [True, True, True, False]
    assert kept(top_p=0.7) == [True, True, False, False]
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_p=1e-6) == [True, False, False, False]
    assert kept(top_k=2, top_p=0.4) == [True, False, False, False]


def test_sampling_frequencies_follow_filtered_distribution():
    """Temperature first, then the nucleus, then renormalisation (hand computed)."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    B = 4000
    step = lambda ids, state: (jnp.tile(jnp.log(jnp.asarray(probs)), (ids.shape[0], 1)), state)
    out = _fast_jit(lambda: decoding.sample(step, {}, jnp.full((B,), BOS), 1, jax.random.PRNGKey(0),
                                            temperature=2.0, top_p=0.7, eos_id=-1))()
    # T = 2: p^(1/2) normalised = [.379, .294, .208, .120]; the mass before the
    # third token is .673 < .7, so the nucleus keeps three tokens.
    hot = np.sqrt(probs)[:3] / np.sqrt(probs)[:3].sum()
    freq = np.bincount(np.asarray(out)[:, 0], minlength=4) / B
    np.testing.assert_allclose(freq, [*hot, 0.0], atol=0.03)


def test_sampling_limits_seeding_and_variation():
    model, params = _deconly(position_encoding="rope", num_kv_heads=2)
    greedy, _ = _greedy_and_reference_deconly(model, params)
    # One compiled sampler for every setting: they are traced arguments.
    draw = _fast_jit(lambda p, key, temperature, top_k, top_p: gen.generate(
        model, p, PROMPTS, max_new_tokens=8, eos_id=-1, rng=key, temperature=temperature,
        top_k=top_k, top_p=top_p))
    key, other_key = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    np.testing.assert_array_equal(draw(params, key, 1.0, 1, 1.0), greedy)
    np.testing.assert_array_equal(draw(params, key, 1.0, 0, 1e-6), greedy)
    first = draw(params, key, 1.0, 0, 1.0)
    np.testing.assert_array_equal(draw(params, key, 1.0, 0, 1.0), first)
    assert not np.array_equal(draw(params, other_key, 1.0, 0, 1.0), first)
    assert not np.array_equal(first, greedy)


def test_translation_sampling_top1_seeding_and_per_row_keys():
    """translate_sample over decoding.sample: top_k=1 is greedy, a key fixes the
    sample, another key changes it, and with one key per row a row's sample does
    not depend on the rest of the batch."""
    model, params = _encdec(position_encoding="rope", num_kv_heads=2)
    greedy, _ = _greedy_and_reference_encdec(model, params)
    draw = _fast_jit(lambda p, src, keys, temperature, top_k: gen.translate_sample(
        model, p, src, keys, temperature=temperature, top_k=top_k, max_extra=4, eos_id=-1))
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    other = jax.random.split(jax.random.PRNGKey(1), 2)
    np.testing.assert_array_equal(draw(params, SOURCES, keys, 1.0, 1), greedy)
    first = draw(params, SOURCES, keys, 1.0, 0)
    np.testing.assert_array_equal(draw(params, SOURCES, keys, 1.0, 0), first)
    assert not np.array_equal(draw(params, SOURCES, other, 1.0, 0), first)
    assert not np.array_equal(first, greedy)
    np.testing.assert_array_equal(draw(params, SOURCES[1:], keys[1:], 1.0, 0), first[1:])
    with pytest.raises(ValueError, match="temperature"):
        gen.translate_sample(model, params, SOURCES, keys, temperature=0.0)
    with pytest.raises(ValueError, match=r"one per row \(2\)"):
        gen.translate_sample(model, params, SOURCES, jax.random.split(keys[0], 3))


def test_bad_arguments_raise_value_errors():
    step, state, first = _scripted(8, [2])
    with pytest.raises(ValueError, match="alpha"):
        decoding.beam_search(step, state, first, 5, alpha=-0.1)
    with pytest.raises(ValueError, match="beam_size"):
        decoding.beam_search(step, state, first, 5, beam_size=0)
    with pytest.raises(ValueError, match="temperature"):
        decoding.sample(step, state, first, 5, jax.random.PRNGKey(0), temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        decoding.sample(step, state, first, 5, jax.random.PRNGKey(0), top_p=0.0)
    with pytest.raises(ValueError, match="max_len"):
        decoding.greedy_search(step, state, first, 0)
    model, params = _encdec()
    with pytest.raises(TypeError, match="DecoderOnly"):
        gen.generate(model, params, PROMPTS, max_new_tokens=2, greedy=True)

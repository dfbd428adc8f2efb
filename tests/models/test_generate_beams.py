"""Decoder-only beam search (generate.generate_beams): exact against exhaustive
search, its scores against a teacher-forced forward, greedy at beam size 1."""

import jax
import jax.numpy as jnp
import numpy as np

from tests.models.test_decoding import (
    EOS,
    PAD,
    PROMPTS,
    _all_hypotheses,
    _assert_varied,
    _config,
    _fast_jit,
    _random_params,
)
from transformer_zoo import models
from transformer_zoo.models import decoding
from transformer_zoo.models import generate as gen


def _continuation_logp(model, params, prompts, seqs, lengths):
    """log P(seq | prompt) [B, n] of every continuation seqs [n, L] (counting its
    first lengths[n] tokens) after every prompt [B, P] (PAD after it): one forward
    of prompt + continuation laid out from position 0, no cache."""
    prompts, seqs = np.asarray(prompts), np.asarray(seqs)
    (B, P), (n, L) = prompts.shape, seqs.shape
    plen = (prompts != PAD).sum(1)
    rows = np.full((B, n, P + L), PAD, np.int32)
    for b in range(B):
        rows[b, :, : plen[b]] = prompts[b, : plen[b]]
        rows[b, :, plen[b] : plen[b] + L] = seqs
    cols = np.arange(P + L)
    segmentation = (cols[None] < (plen + L)[:, None]).astype(np.int32)
    logits = _fast_jit(model.apply)({"params": params}, jnp.asarray(rows.reshape(B * n, -1)),
                                    jnp.asarray(np.repeat(segmentation, n, axis=0)))
    logp = np.asarray(jax.nn.log_softmax(logits), np.float64).reshape(B, n, P + L, -1)
    # The logits at position plen + t predict token t of the continuation.
    at = plen[:, None, None] + np.arange(L)[None, None]  # [B, 1, L]
    tokens = logp[np.arange(B)[:, None, None], np.arange(n)[None, :, None], at, seqs[None]]
    counted = np.arange(L)[None, None] < np.asarray(lengths)[..., None]
    return (tokens * counted).sum(-1)


def _lp(lengths, alpha):
    return ((5.0 + np.asarray(lengths, np.float64)) / 6.0) ** alpha


def test_large_beam_is_exact_and_beats_greedy():
    """Beam 64 keeps all 4^3 live prefixes of 4 new tokens over a vocabulary of
    5, so it finds the 10 best hypotheses of an exhaustive search; the best one
    scores at least what greedy's output scores under the same penalty."""
    vocab, new, alpha = 5, 4, 0.6
    model = models.DecoderOnly(_config(vocab_size=vocab, num_decoder_layers=2))
    prompts = jnp.array([[3, 4, 0], [4, 3, 3], [0, 0, 0]])  # one empty prompt
    params = _random_params(model, prompts)

    @_fast_jit
    def run(p):
        beams = gen.generate_beams(model, p, prompts, max_new_tokens=new, beam_size=64,
                                   alpha=alpha)
        return beams, gen.generate(model, p, prompts, max_new_tokens=new, greedy=True)

    (seqs, scores), greedy = run(params)
    hyps, lengths = _all_hypotheses(vocab, new)
    refs = _continuation_logp(model, params, prompts, hyps, lengths)
    refs = refs / _lp(lengths, alpha)[None]
    for b, ref in enumerate(refs):
        order = np.argsort(-ref)[:10]
        np.testing.assert_array_equal(np.asarray(seqs[b, :10]), hyps[order])
        np.testing.assert_allclose(np.asarray(scores[b, :10]), ref[order], rtol=1e-5, atol=1e-5)
        greedy_index = np.flatnonzero((hyps == np.asarray(greedy[b])).all(1))
        assert greedy_index.size == 1
        assert scores[b, 0] >= ref[greedy_index[0]] - 1e-5
    assert len({tuple(np.asarray(s).tolist()) for s in seqs[:, 0]}) > 1  # prompts matter


def test_beams_scores_match_forward_and_beam_one_is_greedy():
    """On left-padded prompts of three lengths (one empty): every beam's score is
    log P / lp of its tokens under a cache-free forward, the recompute path finds
    the same beams, and one beam without EOS is greedy decoding."""
    model = models.DecoderOnly(_config(position_encoding="rope", num_kv_heads=2))
    params = _random_params(model, PROMPTS)
    new, alpha = 8, 0.6

    @_fast_jit
    def run(p):
        beams = gen.generate_beams(model, p, PROMPTS, max_new_tokens=new, beam_size=4, alpha=alpha)
        recomputed = gen.generate_beams(model, p, PROMPTS, max_new_tokens=new, beam_size=4,
                                        alpha=alpha, use_cache=False)
        one, _ = gen.generate_beams(model, p, PROMPTS, max_new_tokens=new, beam_size=1, eos_id=-1)
        greedy = gen.generate(model, p, PROMPTS, max_new_tokens=new, greedy=True, eos_id=-1)
        return beams, recomputed[0], one[:, 0], greedy

    (seqs, scores), recomputed, one, greedy = map(jax.device_get, run(params))
    _assert_varied(greedy)
    np.testing.assert_array_equal(one, greedy)
    np.testing.assert_array_equal(recomputed, seqs)
    assert (scores > decoding.NEG_INF / 2).all()
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    for b in range(PROMPTS.shape[0]):
        lengths = np.array([list(s).index(EOS) + 1 if EOS in s else new for s in seqs[b]])
        logp = _continuation_logp(model, params, PROMPTS[b : b + 1], seqs[b], lengths)[0]
        np.testing.assert_allclose(scores[b], logp / _lp(lengths, alpha), rtol=1e-4, atol=1e-4)
    assert not np.array_equal(seqs[0], seqs[1])

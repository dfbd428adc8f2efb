"""Decoding algorithms: greedy, beam search and sampling.

Everything here is pure JAX over a step function

    tokens_to_logits(ids [B, 1], state) -> (logits [B, V] or [B, 1, V], new_state)

that feeds one token per row and returns the next-token logits. `state` is any
pytree the caller owns (a KV cache, plus whatever per-row data the step needs).
Loops are `lax.while_loop`s with static shapes, so every function here traces
under `jax.jit`; the model-level wrappers in models/generate.py jit them.

Rows of the batch are independent sequences: each stops at its own EOS (or at
its own length limit) and is padded with `pad_id` after it, while the loop runs
until every row is done or `max_len` tokens were generated.

Beam search follows the paper (Vaswani et al. 2017, Sec. 6.1) and GNMT (Wu et
al. 2016): hypotheses are ranked by log P(Y|X) / lp(Y) with
lp(Y) = ((5 + |Y|) / 6)^alpha, and the search stops once no live hypothesis can
beat the finished ones. The state of a beam search has B * beam_size rows: every
state leaf with a leading axis is tiled per beam and re-gathered as beams are
reordered; scalar leaves (e.g. a shared cache index) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = Any
PyTree = Any
TokensToLogits = Callable[[Array, PyTree], tuple[Array, PyTree]]
PathPredicate = Callable[[tuple], bool]

# Finite "minus infinity" for log-probabilities and scores: sums and divisions
# of it stay finite (no inf - inf = NaN), and anything below NEG_INF / 2 is dead.
NEG_INF = -1.0e7


def _step(tokens_to_logits: TokensToLogits, ids: Array, state: PyTree):
    """Feeds ids [B] and returns float32 logits [B, V] and the new state."""
    logits, state = tokens_to_logits(ids[:, None], state)
    return logits.reshape(ids.shape[0], logits.shape[-1]).astype(jnp.float32), state


def _row_limits(max_len: int, max_lens: Array | None, batch: int) -> Array:
    """Per-row length limits [B]: `max_lens` capped at `max_len`."""
    if max_lens is None:
        return jnp.full((batch,), max_len, jnp.int32)
    return jnp.minimum(jnp.asarray(max_lens, jnp.int32), max_len)


def _check_max_len(max_len: int) -> None:
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int (a static length), got {max_len!r}")


# --------------------------------------------------------------------------- greedy / sampling


class _LoopState(NamedTuple):
    step: Array  # scalar: tokens generated so far
    seqs: Array  # [B, 1 + max_len]: the first id, then the generated tokens
    done: Array  # [B] bool
    state: PyTree


def _token_loop(tokens_to_logits, state, first_ids, max_len, select, eos_id, pad_id, max_lens):
    """Shared loop of greedy and sampling: `select(logits [B, V], step) -> ids [B]`."""
    _check_max_len(max_len)
    B = first_ids.shape[0]
    limits = _row_limits(max_len, max_lens, B)
    seqs = jnp.full((B, max_len + 1), pad_id, jnp.int32).at[:, 0].set(first_ids)
    init = _LoopState(jnp.zeros((), jnp.int32), seqs, jnp.zeros((B,), bool), state)

    def cond(s: _LoopState):
        return (s.step < max_len) & ~jnp.all(s.done)

    def body(s: _LoopState):
        logits, state = _step(tokens_to_logits, s.seqs[:, s.step], s.state)
        token = jnp.where(s.done, pad_id, select(logits, s.step).astype(jnp.int32))
        seqs = lax.dynamic_update_slice(s.seqs, token[:, None], (0, s.step + 1))
        done = s.done | (token == eos_id) | (s.step + 1 >= limits)
        return _LoopState(s.step + 1, seqs, done, state)

    return lax.while_loop(cond, body, init).seqs[:, 1:]


def greedy_search(
    tokens_to_logits: TokensToLogits,
    state: PyTree,
    first_ids: Array,
    max_len: int,
    *,
    eos_id: int = 1,
    pad_id: int = 0,
    max_lens: Array | None = None,
) -> Array:
    """Argmax decoding.

    Args:
      tokens_to_logits: the step function (see the module docstring).
      state: its initial state (e.g. an initialised KV cache).
      first_ids: [B] the first token fed (BOS, or the last prompt token).
      max_len: static number of tokens to generate at most.
      eos_id: end of sequence; a row stops after emitting it (-1: never).
      pad_id: written after a row's EOS.
      max_lens: optional [B] per-row limits (<= max_len).

    Returns:
      [B, max_len] int32 generated tokens (EOS included), pad_id after EOS.
    """
    select = lambda logits, step: first_argmax(logits)
    return _token_loop(tokens_to_logits, state, first_ids, max_len, select, eos_id, pad_id,
                       max_lens)


def first_argmax(x: Array) -> Array:
    """jnp.argmax(x, axis=-1) (first maximum; first NaN if any), from two plain reduces.

    XLA:CPU lowers argmax to a (value, index) reduce that does not vectorise:
    over [8, 8192] logits it took 0.34 ms alone where a max, then the lowest
    index holding it, takes 0.09 ms and returns the same index; the greedy
    decoding step got 1.07x faster on a 2-core AMD Zen 5 (benchmarks/README.md,
    "argmax and weight gradients").

    Args:
      x: [..., V] float scores, V < 2^24 (the indices are reduced as float32).

    Returns:
      [...] int32 indices.
    """
    V = x.shape[-1]
    if V >= 2**24 or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    nan = jnp.isnan(x)
    # XLA:CPU's vectorised max may skip NaNs, so rows holding one are told apart.
    hit = jnp.where(nan.any(-1, keepdims=True), nan, x == x.max(-1, keepdims=True))
    index = lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, float(V)), axis=-1).astype(jnp.int32)


def filter_logits(logits: Array, top_k: Array | int = 0, top_p: Array | float = 1.0) -> Array:
    """Keeps the top-k logits, then the nucleus of mass top_p; others -> -inf.

    `top_k` and `top_p` may be traced, so one compiled sampler serves them all.

    Args:
      logits: [B, V] float32 (already divided by the temperature).
      top_k: keep the k largest (0: all); ties with the k-th are kept.
      top_p: keep the smallest set of most likely tokens whose probability
        reaches top_p; the most likely token is always kept (1.0: all).

    Returns:
      [B, V] logits with the dropped entries at -inf.
    """
    V = logits.shape[-1]
    k = jnp.clip(jnp.where(top_k > 0, top_k, V), 1, V)
    sorted_logits = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(sorted_logits, jnp.full((logits.shape[0], 1), k - 1), axis=-1)
    sorted_logits = jnp.where(jnp.arange(V) < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # In the nucleus if the mass strictly before the token is < top_p; top_p = 1
    # keeps all (a float32 cumsum can reach 1 before the tail).
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p) | (top_p >= 1.0)
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((logits >= kth) & (logits >= threshold), logits, -jnp.inf)


def check_sampling(temperature, top_k, top_p) -> None:
    """ValueError for out-of-range sampling settings (traced values are not checked)."""
    concrete = lambda x: isinstance(x, int | float)
    if concrete(temperature) and not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (use greedy for argmax), got {temperature}")
    if concrete(top_k) and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if concrete(top_p) and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def _per_row_keys(rng: Array, batch: int) -> bool:
    """True for [B] keys (typed) or [B, 2] raw keys, False for one key; else ValueError."""
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    ndim = rng.ndim if typed else rng.ndim - 1
    if ndim == 0:
        return False
    if ndim == 1 and rng.shape[0] == batch:
        return True
    raise ValueError(f"rng must be one PRNG key or one per row ({batch}), got shape {rng.shape}")


def sample(
    tokens_to_logits: TokensToLogits,
    state: PyTree,
    first_ids: Array,
    max_len: int,
    rng: Array,
    *,
    temperature: Array | float = 1.0,
    top_k: Array | int = 0,
    top_p: Array | float = 1.0,
    eos_id: int = 1,
    pad_id: int = 0,
    max_lens: Array | None = None,
) -> Array:
    """Ancestral sampling with temperature, top-k and nucleus (top-p) filtering.

    Args:
      tokens_to_logits: the step function (see the module docstring).
      state: its initial state.
      first_ids: [B] the first token fed.
      max_len: static number of tokens to generate at most.
      rng: PRNG key; step t uses fold_in(rng, t), so a seed fixes the output.
        Or [B] keys, one per row: then a row's tokens depend only on its own
        key and inputs, not on the other rows of the batch.
      temperature: logits are divided by it (> 0).
      top_k: sample among the k most likely tokens (0: off).
      top_p: sample within the nucleus of mass top_p (1.0: off).
        (temperature, top_k and top_p may be traced.)
      eos_id: end of sequence (-1: never).
      pad_id: written after a row's EOS.
      max_lens: optional [B] per-row limits.

    Returns:
      [B, max_len] int32 sampled tokens, pad_id after EOS.
    """
    check_sampling(temperature, top_k, top_p)

    per_row = _per_row_keys(rng, first_ids.shape[0])
    draw = lambda key, step, logits: jax.random.categorical(jax.random.fold_in(key, step), logits,
                                                            axis=-1)

    def select(logits, step):
        filtered = filter_logits(logits / temperature, top_k, top_p)
        if per_row:
            return jax.vmap(draw, in_axes=(0, None, 0))(rng, step, filtered)
        return draw(rng, step, filtered)

    return _token_loop(tokens_to_logits, state, first_ids, max_len, select, eos_id, pad_id,
                       max_lens)


# --------------------------------------------------------------------------------- beam search


def length_penalty(length: Array, alpha: float) -> Array:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (float32)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def tile_beams(tree: PyTree, beam_size: int) -> PyTree:
    """Repeats every leaf with a leading batch axis per beam: [B, ...] -> [B * beam, ...]."""

    def tile(x):
        x = jnp.asarray(x)
        if x.ndim == 0:
            return x
        return jnp.repeat(x, beam_size, axis=0)

    return jax.tree_util.tree_map(tile, tree)


def _gather(x: Array, idx: Array) -> Array:
    """x [B, M, ...] indexed per row by idx [B, K] -> [B, K, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, idx)


def _gather_state(tree: PyTree, beam_idx: Array, per_source: PathPredicate | None) -> PyTree:
    """Reorders the [B * beam, ...] leaves by beam_idx [B, beam] (beams of the same row).

    Leaves marked per_source hold the same value for every beam of a row, so
    reordering within the row would copy them unchanged: they are skipped.
    """
    B, K = beam_idx.shape
    flat = (jnp.arange(B)[:, None] * K + beam_idx).reshape(-1)

    def reorder(path, x):
        if jnp.ndim(x) == 0 or (per_source is not None and per_source(path)):
            return x
        return x[flat]

    return jax.tree_util.tree_map_with_path(reorder, tree)


class _BeamState(NamedTuple):
    step: Array  # scalar: tokens generated so far
    live_seqs: Array  # [B, K, 1 + L], sorted by live_logprobs
    live_logprobs: Array  # [B, K]; NEG_INF = no hypothesis
    finished_seqs: Array  # [B, K, 1 + L], sorted by finished_scores
    finished_scores: Array  # [B, K] log P / lp; NEG_INF = empty slot
    state: PyTree  # leaves [B * K, ...]


def _init_beams(state, first_ids, max_len, beam_size, pad_id) -> _BeamState:
    B = first_ids.shape[0]
    seqs = jnp.full((B, beam_size, max_len + 1), pad_id, jnp.int32)
    seqs = seqs.at[:, :, 0].set(first_ids[:, None])
    # Only beam 0 is alive at first, so the first expansion is not K copies of it.
    logprobs = jnp.where(jnp.arange(beam_size) == 0, 0.0, NEG_INF)
    logprobs = jnp.broadcast_to(logprobs, (B, beam_size)).astype(jnp.float32)
    scores = jnp.full((B, beam_size), NEG_INF, jnp.float32)
    return _BeamState(jnp.zeros((), jnp.int32), seqs, logprobs, seqs, scores,
                      tile_beams(state, beam_size))


def _expand(tokens_to_logits, s: _BeamState):
    """Top 2K one-token extensions of the live beams (at most K of them end in EOS)."""
    B, K = s.live_logprobs.shape
    ids = s.live_seqs[:, :, s.step].reshape(B * K)
    logits, state = _step(tokens_to_logits, ids, s.state)
    logp = jax.nn.log_softmax(logits, axis=-1).reshape(B, K, -1)
    V = logp.shape[-1]
    candidates = (s.live_logprobs[:, :, None] + logp).reshape(B, K * V)
    top_logp, top_idx = lax.top_k(candidates, min(2 * K, K * V))
    beam_idx, tokens = top_idx // V, (top_idx % V).astype(jnp.int32)
    seqs = _gather(s.live_seqs, beam_idx)
    seqs = seqs.at[:, :, s.step + 1].set(tokens)
    return seqs, top_logp, beam_idx, tokens, state


def _beam_body(tokens_to_logits, s: _BeamState, limits, alpha, eos_id, per_source) -> _BeamState:
    K = s.live_logprobs.shape[1]
    seqs, top_logp, beam_idx, tokens, state = _expand(tokens_to_logits, s)
    length = s.step + 1
    valid = top_logp > NEG_INF / 2
    ends = (tokens == eos_id) | (length >= limits[:, None])
    # Live: the best K candidates that go on.
    live_logp, keep = lax.top_k(jnp.where(ends | ~valid, NEG_INF, top_logp), K)
    state = _gather_state(state, _gather(beam_idx, keep), per_source)
    # Finished: merge the candidates that end here into the K best so far.
    scores = jnp.where(ends & valid, top_logp / length_penalty(length, alpha), NEG_INF)
    fin_scores, fin_idx = lax.top_k(jnp.concatenate([s.finished_scores, scores], axis=1), K)
    fin_seqs = _gather(jnp.concatenate([s.finished_seqs, seqs], axis=1), fin_idx)
    return _BeamState(length, _gather(seqs, keep), live_logp, fin_seqs, fin_scores, state)


def _beam_running(s: _BeamState, max_len, limits, alpha) -> Array:
    """False once, in every row, no live beam can beat the K-th finished one.

    Log-probabilities only fall as a hypothesis grows, and with alpha >= 0 the
    penalty is largest at the row's limit, so the best live log-prob divided by
    lp(limit) bounds every score a live beam can still reach.
    """
    best_live = s.live_logprobs[:, 0]
    bound = best_live / length_penalty(limits, alpha)
    row_done = (best_live <= NEG_INF / 2) | (bound <= s.finished_scores[:, -1])
    return (s.step < max_len) & ~jnp.all(row_done)


def beam_search(
    tokens_to_logits: TokensToLogits,
    state: PyTree,
    first_ids: Array,
    max_len: int,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    eos_id: int = 1,
    pad_id: int = 0,
    max_lens: Array | None = None,
    per_source: PathPredicate | None = None,
) -> tuple[Array, Array]:
    """Beam search with the GNMT length penalty and early termination.

    A hypothesis is finished when it emits EOS or reaches its row's limit
    (then it is scored as it stands); its score is log P(Y|X) / lp(|Y|), with
    |Y| the number of generated tokens including EOS.

    Args:
      tokens_to_logits: the step function; it is called on B * beam_size rows.
      state: its initial state for B rows; leaves with a leading axis are tiled
        per beam (e.g. a KV cache prefilled once per source), scalars kept.
      first_ids: [B] the first token fed (BOS, or the last prompt token).
      max_len: static number of tokens to generate at most.
      beam_size: K hypotheses kept per row.
      alpha: length penalty exponent (>= 0; 0 = raw log-probabilities).
      eos_id: end of sequence (-1: never).
      pad_id: written after EOS.
      max_lens: optional [B] per-row limits (e.g. source length + 50).
      per_source: optional predicate on a state leaf's key path
        (`jax.tree_util` keys): True for leaves the step never changes
        per beam (the encoder output, cross-attention keys/values). They are
        tiled once and not reordered after each step, which would copy them
        unchanged; a leaf wrongly marked would keep stale beams.

    Returns:
      sequences [B, K, max_len] int32 (best first, pad_id after EOS) and their
      scores [B, K] float32 (NEG_INF for empty slots).
    """
    _check_max_len(max_len)
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (the early-termination bound needs it), got {alpha}")
    limits = _row_limits(max_len, max_lens, first_ids.shape[0])
    init = _init_beams(state, first_ids, max_len, beam_size, pad_id)
    final = lax.while_loop(
        lambda s: _beam_running(s, max_len, limits, alpha),
        lambda s: _beam_body(tokens_to_logits, s, limits, alpha, eos_id, per_source),
        init,
    )
    return final.finished_seqs[:, :, 1:], final.finished_scores

"""Model-level decoding for the two families that generate.

    search    EncoderDecoder                     DecoderOnly
    greedy    translate_greedy                   generate(greedy=True)
    beam      translate / translate_beams        generate_beams
    sample    translate_sample                   generate(rng=...)

Each wrapper builds a step function `tokens_to_logits(ids [B, 1], state)` for
models/decoding.py and jits the whole search (model and search settings are
static arguments). Two step functions exist per family:

* cached (default): the encoder runs once per source and the cache-creating
  call projects the cross-attention keys/values once; each step then feeds one
  token and appends its keys/values to the self-attention cache. With
  kernels=CPU the steps also read transposed kernels that
  `cpu_kernels.decode_weights` builds from the parameters inside the jitted
  search, so they always match the parameters passed in;
* `use_cache=False`, the reference the benchmark compares against: each step
  reruns the full teacher-forced decoder over the prefix padded to the maximum
  length and reads the logits at the current position.

Decoder-only prompts of different lengths are right-aligned (left-padded) so
that every row's next token lands in the same cache slot: the cache index is a
scalar shared by the batch. Each row gets explicit positions (0 at its BOS) and
a slot validity mask that hides its padding slots; ALiBi and causality only use
slot differences, which left padding leaves unchanged within a row.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import meta
from jax import lax

from transformer_zoo.models import cpu_kernels, decoding
from transformer_zoo.models.transformer import DecoderOnly, EncoderDecoder, default_segmentation
from transformer_zoo.models.variants import Kernels

Array = Any


def _eos(model, eos_id: int | None) -> int:
    """The end-of-sequence id: as given, else the model config's."""
    return model.config.eos_id if eos_id is None else eos_id


def _check_model(model, family) -> None:
    if not isinstance(model, family):
        raise TypeError(f"expected a {family.__name__}, got {type(model).__name__}")


# ------------------------------------------------------------------------------ EncoderDecoder


def _fixed_variables(model, params) -> dict:
    """The variables every step reads and none writes: the parameters and, with
    kernels=CPU, the decoder's streamed-layout weights built from them. They
    stay outside the search state, which beam search reorders every step."""
    fixed = {"params": params}
    if model.config.kernels == Kernels.CPU:
        decoder = cpu_kernels.decode_weights(meta.unbox(params["decoder"]))
        fixed[cpu_kernels.DECODE_WEIGHTS] = {"decoder": decoder}
    return fixed


def _encdec_cached(model, params, encoded, src_seg, max_len):
    """Cache-creating call (projects cross K/V once), then one token per step."""
    B = encoded.shape[0]
    dummy = jnp.zeros((B, max_len), jnp.int32)
    fixed = _fixed_variables(model, params)
    _, init = model.apply(fixed, encoded, src_seg, dummy, decode=True, mutable=["cache"],
                          method=EncoderDecoder.decode)

    def step(ids, state):
        logits, new = model.apply(
            {**fixed, "cache": state["cache"]}, state["encoded"], state["src_seg"], ids,
            decode=True, mutable=["cache"], method=EncoderDecoder.decode,
        )
        return logits, {**state, "cache": new["cache"]}

    return step, {"cache": init["cache"], "encoded": encoded, "src_seg": src_seg}


def _encdec_recompute(model, params, encoded, src_seg, max_len):
    """No cache: the full decoder over the prefix buffer [B, max_len] each step."""
    B = encoded.shape[0]

    def step(ids, state):
        buffer = lax.dynamic_update_slice(state["buffer"], ids, (0, state["index"]))
        # All slots are valid tokens (a generated PAD id too); causality hides the future.
        logits = model.apply({"params": params}, state["encoded"], state["src_seg"], buffer,
                             jnp.ones_like(buffer), method=EncoderDecoder.decode)
        logits = lax.dynamic_slice_in_dim(logits, state["index"], 1, axis=1)
        return logits, {**state, "buffer": buffer, "index": state["index"] + 1}

    state = {"buffer": jnp.zeros((B, max_len), jnp.int32), "index": jnp.zeros((), jnp.int32),
             "encoded": encoded, "src_seg": src_seg}
    return step, state


def prepare_translation(model: EncoderDecoder, params, inputs: Array, max_len: int, *,
                        use_cache: bool = True):
    """Encodes the sources once and builds the decoder's step function.

    Args:
      model: an EncoderDecoder.
      params: its parameters.
      inputs: [B, S] source ids, PAD after each sentence.
      max_len: static number of target tokens to generate at most.
      use_cache: KV-cached steps, or full recomputation (the reference).

    Returns:
      (tokens_to_logits, state, first_ids [B] = BOS) for models/decoding.py.
    """
    _check_model(model, EncoderDecoder)
    cfg = model.config
    src_seg = default_segmentation(inputs, cfg.pad_id)
    encoded = model.apply({"params": params}, inputs, src_seg, method=EncoderDecoder.encode)
    build = _encdec_cached if use_cache else _encdec_recompute
    step, state = build(model, params, encoded, src_seg, max_len)
    if cfg.bos_id == cfg.pad_id != cfg.eos_id:
        step = _never(step, cfg.pad_id)
    return step, state, jnp.full((inputs.shape[0],), cfg.bos_id, jnp.int32)


def _never(step, token: int):
    """`step` whose logits never choose `token`.

    Models that start decoding from their pad id (Marian, T5) have it in the
    output vocabulary; it is never a prediction (transformers forbids it
    through the checkpoints' bad_words_ids).
    """
    def wrapped(ids, state):
        logits, state = step(ids, state)
        return logits.at[..., token].set(decoding.NEG_INF), state

    return wrapped


# State leaves fixed per source sentence: beams of a row share them (see beam_search).
_PER_SOURCE_KEYS = frozenset({"encoded", "src_seg", "cross_key", "cross_value"})


def per_source_leaf(path: tuple) -> bool:
    """True for translation state leaves that are the same for every beam of a row."""
    return any(getattr(k, "key", None) in _PER_SOURCE_KEYS for k in path)


def _source_limits(model, inputs, max_extra):
    """The paper's per-sentence limit: source length + max_extra, [B]."""
    return jnp.sum(inputs != model.config.pad_id, axis=1).astype(jnp.int32) + max_extra


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("beam_size", "alpha", "max_extra", "eos_id", "use_cache"))
def translate_beams(model: EncoderDecoder, params, inputs: Array, *, beam_size: int = 4,
                    alpha: float = 0.6, max_extra: int = 50, eos_id: int | None = None,
                    use_cache: bool = True) -> tuple[Array, Array]:
    """Beam search translation, all beams.

    Args:
      model: an EncoderDecoder.
      params: its parameters.
      inputs: [B, S] source ids, PAD after each sentence.
      beam_size: beams per sentence.
      alpha: GNMT length penalty exponent.
      max_extra: a sentence of n source tokens gets at most n + max_extra
        target tokens (the buffer holds S + max_extra).
      eos_id: end of sequence (None: config.eos_id; -1: never stop early).
      use_cache: KV-cached steps, or full recomputation.

    Returns:
      sequences [B, beam_size, S + max_extra] (best first, PAD after EOS) and
      scores [B, beam_size].
    """
    max_len = inputs.shape[1] + max_extra
    step, state, first = prepare_translation(model, params, inputs, max_len, use_cache=use_cache)
    return decoding.beam_search(step, state, first, max_len, beam_size=beam_size, alpha=alpha,
                                eos_id=_eos(model, eos_id), pad_id=model.config.pad_id,
                                max_lens=_source_limits(model, inputs, max_extra),
                                per_source=per_source_leaf)


def translate(model: EncoderDecoder, params, inputs: Array, *, beam_size: int = 4,
              alpha: float = 0.6, max_extra: int = 50, eos_id: int | None = None,
              use_cache: bool = True) -> Array:
    """Beam search translation (the paper: beam 4, alpha 0.6, source length + 50).

    Args: as `translate_beams`.

    Returns:
      [B, S + max_extra] token ids of the best beam, PAD after EOS.
    """
    seqs, _ = translate_beams(model, params, inputs, beam_size=beam_size, alpha=alpha,
                              max_extra=max_extra, eos_id=eos_id, use_cache=use_cache)
    return seqs[:, 0]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("max_extra", "eos_id", "use_cache"))
def translate_greedy(model: EncoderDecoder, params, inputs: Array, *, max_extra: int = 50,
                     eos_id: int | None = None, use_cache: bool = True) -> Array:
    """Greedy translation: [B, S] sources -> [B, S + max_extra] ids, PAD after EOS."""
    max_len = inputs.shape[1] + max_extra
    step, state, first = prepare_translation(model, params, inputs, max_len, use_cache=use_cache)
    return decoding.greedy_search(step, state, first, max_len, eos_id=_eos(model, eos_id),
                                  pad_id=model.config.pad_id,
                                  max_lens=_source_limits(model, inputs, max_extra))


def _sampling(rng, temperature, top_k, top_p) -> tuple:
    """The checked sampling settings as traced arrays: one compilation serves them all."""
    decoding.check_sampling(temperature, top_k, top_p)
    return rng, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)


def translate_sample(model: EncoderDecoder, params, inputs: Array, rng: Array, *,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     max_extra: int = 50, eos_id: int | None = None,
                     use_cache: bool = True) -> Array:
    """Sampled translations (temperature, top-k, nucleus) over `decoding.sample`.

    One compilation serves every temperature / top_k / top_p (they are traced).

    Args:
      model: an EncoderDecoder.
      params: its parameters.
      inputs: [B, S] source ids, PAD after each sentence.
      rng: one PRNG key, or [B] keys (one per row: a row's sample then does not
        depend on the other rows of the batch).
      temperature: sampling temperature (> 0).
      top_k: sample among the k most likely tokens (0: off).
      top_p: nucleus mass (1.0: off).
      max_extra: at most source length + max_extra target tokens.
      eos_id: end of sequence (None: config.eos_id; -1: never stop early).
      use_cache: KV-cached steps, or full recomputation.

    Returns:
      [B, S + max_extra] sampled token ids, PAD after EOS.
    """
    _check_model(model, EncoderDecoder)
    sampling = _sampling(rng, temperature, top_k, top_p)
    return _translate_sample(model, params, inputs, sampling, max_extra=max_extra, eos_id=eos_id,
                             use_cache=use_cache)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("max_extra", "eos_id", "use_cache"))
def _translate_sample(model, params, inputs, sampling, *, max_extra, eos_id, use_cache):
    rng, temperature, top_k, top_p = sampling
    max_len = inputs.shape[1] + max_extra
    step, state, first = prepare_translation(model, params, inputs, max_len, use_cache=use_cache)
    return decoding.sample(step, state, first, max_len, rng, temperature=temperature, top_k=top_k,
                           top_p=top_p, eos_id=_eos(model, eos_id), pad_id=model.config.pad_id,
                           max_lens=_source_limits(model, inputs, max_extra))


# --------------------------------------------------------------------------------- DecoderOnly


def _right_align(model, prompts, prompt_lengths):
    """[BOS] + prompt per row, right-aligned in [B, P + 1]; also the pad widths [B]."""
    cfg = model.config
    B, P = prompts.shape
    if prompt_lengths is None:
        prompt_lengths = jnp.sum(prompts != cfg.pad_id, axis=1)
    pad = P - jnp.asarray(prompt_lengths, jnp.int32)
    seq = jnp.concatenate([jnp.full((B, 1), cfg.bos_id, prompts.dtype), prompts], axis=1)
    cols = jnp.arange(P + 1)[None] - pad[:, None]
    aligned = jnp.take_along_axis(seq, jnp.maximum(cols, 0), axis=1)
    return jnp.where(cols >= 0, aligned, cfg.pad_id).astype(jnp.int32), pad


def _decoder_forward(module, tokens, segmentation, positions):
    """DecoderOnly's decoder on already-shifted tokens (no shift_right)."""
    return module.decoder(tokens, segmentation, positions)


def _deconly_cached(model, params, aligned, slot_valid, positions):
    """Cache-creating call, one prefill pass over [BOS] + prompt[:-1], then steps."""
    B, S_max = slot_valid.shape
    P = aligned.shape[1] - 1
    fixed = _fixed_variables(model, params)
    _, init = model.apply(fixed, jnp.zeros((B, S_max), jnp.int32), decode=True,
                          mutable=["cache"])
    cache = init["cache"]
    if P > 0:
        _, new = model.apply({**fixed, "cache": cache}, aligned[:, :P], slot_valid,
                             positions[:, :P], decode=True, mutable=["cache"])
        cache = new["cache"]

    def step(ids, state):
        logits, new = model.apply(
            {**fixed, "cache": state["cache"]}, ids, state["slot_valid"],
            state["position"][:, None], decode=True, mutable=["cache"],
        )
        return logits, {**state, "cache": new["cache"], "position": state["position"] + 1}

    return step, {"cache": cache, "slot_valid": slot_valid, "position": positions[:, P]}


def _deconly_recompute(model, params, aligned, slot_valid, positions):
    """No cache: the full decoder over the slot buffer [B, S_max] each step."""
    P = aligned.shape[1] - 1
    buffer = jnp.zeros(slot_valid.shape, jnp.int32).at[:, :P].set(aligned[:, :P])

    def step(ids, state):
        buffer = lax.dynamic_update_slice(state["buffer"], ids, (0, state["index"]))
        logits = model.apply({"params": params}, buffer, state["slot_valid"], state["positions"],
                             method=_decoder_forward)
        logits = lax.dynamic_slice_in_dim(logits, state["index"], 1, axis=1)
        return logits, {**state, "buffer": buffer, "index": state["index"] + 1}

    state = {"buffer": buffer, "index": jnp.asarray(P, jnp.int32), "slot_valid": slot_valid,
             "positions": positions}
    return step, state


def prepare_generation(model: DecoderOnly, params, prompts: Array, max_new_tokens: int, *,
                       prompt_lengths: Array | None = None, use_cache: bool = True):
    """Right-aligns the prompts, prefills the cache and builds the step function.

    The prefill covers [BOS] + prompt except its last token, which is the first
    id the search feeds: its logits predict the first new token.

    Args:
      model: a DecoderOnly.
      params: its parameters.
      prompts: [B, P] ids, PAD after each prompt (empty prompts allowed).
      max_new_tokens: static number of tokens to generate at most.
      prompt_lengths: optional [B] lengths (default: the non-PAD count).
      use_cache: KV-cached steps, or full recomputation.

    Returns:
      (tokens_to_logits, state, first_ids [B]) for models/decoding.py.
    """
    _check_model(model, DecoderOnly)
    aligned, pad = _right_align(model, prompts, prompt_lengths)
    P = prompts.shape[1]
    slots = jnp.arange(P + max_new_tokens, dtype=jnp.int32)[None]
    slot_valid = (slots >= pad[:, None]).astype(jnp.int32)
    positions = jnp.maximum(slots - pad[:, None], 0)
    build = _deconly_cached if use_cache else _deconly_recompute
    step, state = build(model, params, aligned, slot_valid, positions)
    return step, state, aligned[:, P]


def generate(model: DecoderOnly, params, prompts: Array, *, max_new_tokens: int,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             rng: Array | None = None, eos_id: int | None = None,
             prompt_lengths: Array | None = None, use_cache: bool = True) -> Array:
    """Continues each prompt by greedy decoding or sampling.

    One compilation serves every temperature / top_k / top_p (they are traced).

    Args:
      model: a DecoderOnly.
      params: its parameters.
      prompts: [B, P] ids, PAD after each prompt.
      max_new_tokens: tokens to generate at most.
      greedy: argmax decoding (ignores the sampling arguments and rng).
      temperature: sampling temperature (> 0).
      top_k: sample among the k most likely tokens (0: off).
      top_p: nucleus mass (1.0: off).
      rng: PRNG key, or [B] keys (one per row), required unless greedy.
      eos_id: end of sequence (None: config.eos_id; -1: never stop early).
      prompt_lengths: optional [B] prompt lengths (default: non-PAD count).
      use_cache: KV-cached steps, or full recomputation.

    Returns:
      [B, max_new_tokens] new token ids, PAD after EOS.
    """
    if greedy:
        return _generate(model, params, prompts, prompt_lengths, None,
                         max_new_tokens=max_new_tokens, eos_id=eos_id, use_cache=use_cache)
    if rng is None:
        raise ValueError("generate: sampling needs rng (a PRNG key), or pass greedy=True")
    sampling = _sampling(rng, temperature, top_k, top_p)
    return _generate(model, params, prompts, prompt_lengths, sampling,
                     max_new_tokens=max_new_tokens, eos_id=eos_id, use_cache=use_cache)


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("max_new_tokens", "eos_id", "use_cache"))
def _generate(model, params, prompts, prompt_lengths, sampling, *, max_new_tokens, eos_id,
              use_cache):
    """Greedy when `sampling` is None, else (rng, temperature, top_k, top_p)."""
    step, state, first = prepare_generation(model, params, prompts, max_new_tokens,
                                            prompt_lengths=prompt_lengths, use_cache=use_cache)
    kw = dict(eos_id=_eos(model, eos_id), pad_id=model.config.pad_id)
    if sampling is None:
        return decoding.greedy_search(step, state, first, max_new_tokens, **kw)
    rng, temperature, top_k, top_p = sampling
    return decoding.sample(step, state, first, max_new_tokens, rng, temperature=temperature,
                           top_k=top_k, top_p=top_p, **kw)


# Generation state leaves that every beam of a prompt shares: its slot validity
# and positions (all beams of a row advance together).
_PER_PROMPT_KEYS = frozenset({"slot_valid", "positions", "position"})


def per_prompt_leaf(path: tuple) -> bool:
    """True for generation state leaves that are the same for every beam of a row."""
    return len(path) == 1 and getattr(path[0], "key", None) in _PER_PROMPT_KEYS


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("max_new_tokens", "beam_size", "alpha", "eos_id", "use_cache"))
def generate_beams(model: DecoderOnly, params, prompts: Array, *, max_new_tokens: int,
                   beam_size: int = 4, alpha: float = 0.6, eos_id: int | None = None,
                   prompt_lengths: Array | None = None,
                   use_cache: bool = True) -> tuple[Array, Array]:
    """Beam search continuations of each prompt, all beams (`decoding.beam_search`).

    The search runs on `prepare_generation`'s state (the prompt prefilled once,
    then tiled per beam); a hypothesis's length |Y| in the GNMT penalty counts
    only the new tokens (EOS included).

    Args:
      model: a DecoderOnly.
      params: its parameters.
      prompts: [B, P] ids, PAD after each prompt (empty prompts allowed).
      max_new_tokens: tokens to generate at most.
      beam_size: beams per prompt.
      alpha: GNMT length penalty exponent (>= 0).
      eos_id: end of sequence (None: config.eos_id; -1: never stop early).
      prompt_lengths: optional [B] prompt lengths (default: non-PAD count).
      use_cache: KV-cached steps, or full recomputation.

    Returns:
      sequences [B, beam_size, max_new_tokens] (best first, PAD after EOS) and
      scores [B, beam_size] (log P / lp; decoding.NEG_INF for empty slots).
    """
    step, state, first = prepare_generation(model, params, prompts, max_new_tokens,
                                            prompt_lengths=prompt_lengths, use_cache=use_cache)
    return decoding.beam_search(step, state, first, max_new_tokens, beam_size=beam_size,
                                alpha=alpha, eos_id=_eos(model, eos_id), pad_id=model.config.pad_id,
                                per_source=per_prompt_leaf)

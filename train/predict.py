"""Text in, text out: decode held-out examples and score them.

Used by the training loop (periodic and final metrics), by `load_run(...)` and
by `python -m transformer_zoo.train.decode`. One decoding interface serves both
families that generate: `decode_options` turns the options given (search,
beam_size, alpha, n_best, temperature, top_k, top_p, seed, num_samples) into a
validated `DecodeOptions` (greedy, beam search or sampling), refusing what the
search cannot honour; `translate_hypotheses` (encoder-decoder) and
`generate_hypotheses` (decoder-only) decode with it. The training metric is
exact match for the synthetic task and sacreBLEU + chrF for translation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from transformer_zoo.data import load_tokenizer
from transformer_zoo.models import Kernels, ModelConfig, generate
from transformer_zoo.models.decoding import NEG_INF
from transformer_zoo.train.checkpoint import Checkpointer, DamagedCheckpointError
from transformer_zoo.train.scores import metric_scores
from transformer_zoo.train.search import (  # noqa: F401  (re-exported: predict's interface)
    GENERATING_FAMILIES,
    DecodeOptions,
    Hypothesis,
    Search,
    decode_options,
)
from transformer_zoo.train.tasks import Family, get_task

log = logging.getLogger("train")


def encode_batch(tokenizer, texts: Sequence[str], max_length: int | None,
                 vocab_size: int | None = None) -> np.ndarray:
    """Token ids + the tokenizer's EOS, right-padded with its PAD to the longest
    (rounded up to 8): [B, S] int32.

    The ids are checked here, on the host, against `vocab_size` (default: the
    tokenizer's): the model's embedding lookup (jnp.take under jit) cannot
    raise on an out-of-range id, it would silently read a filled row instead.

    Raises:
      TypeError: `texts` is a single str (a sequence of texts is wanted).
      ValueError: a text is longer than `max_length` tokens (names its index),
        or the tokenizer gave an id outside [0, vocab_size).
    """
    _check_texts("texts", texts)
    rows = [list(tokenizer.encode(t)) + [tokenizer.eos_id] for t in texts]
    longest = max((len(r) for r in rows), default=1)
    if max_length is not None:
        for i, r in enumerate(rows):
            if len(r) > max_length:
                raise ValueError(f"input {i} has {len(r)} tokens (with EOS); the model allows "
                                 f"{max_length}: {texts[i][:60]!r}")
    _check_ids(rows, tokenizer.vocab_size if vocab_size is None else vocab_size, texts)
    width = -(-longest // 8) * 8
    out = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def translate_texts(model, params, tokenizer, texts: Sequence[str], *, beam_size: int = 4,
                    alpha: float = 0.6, max_extra: int = 50, batch_size: int = 64,
                    max_input_length: int | None = None) -> list[str]:
    """Translates `texts` (in batches): the best beam, or greedy with beam_size 1."""
    options = (DecodeOptions(search=Search.GREEDY) if beam_size == 1
               else DecodeOptions(search=Search.BEAM, beam_size=beam_size, alpha=alpha))
    found = translate_hypotheses(model, params, tokenizer, texts, options, max_extra=max_extra,
                                 batch_size=batch_size, max_input_length=max_input_length)
    return [h[0].text for h in found]


def translate_hypotheses(model, params, tokenizer, texts: Sequence[str], options: DecodeOptions,
                         *, max_extra: int = 50, batch_size: int = 64,
                         max_input_length: int | None = None) -> list[list[Hypothesis]]:
    """Translates `texts` in batches of `batch_size` with any search.

    Args:
      model: an EncoderDecoder.
      params: its parameters.
      tokenizer: the run's tokenizer.
      texts: source sentences.
      options: the search (see `decode_options`).
      max_extra: at most input length + max_extra output tokens (a learned
        position table caps it).
      batch_size: sentences decoded together; full batches all have
        batch_size rows, so one compiled program serves them.
      max_input_length: longest input in tokens with EOS (ValueError beyond).

    Returns:
      per input, its n-best beams (best first), its samples, or its greedy output.
    """
    outputs: list[list[Hypothesis]] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        n = len(chunk)
        # Every full batch has the same number of rows, so one program serves them.
        chunk += [chunk[-1]] * (batch_size - n) if len(texts) > batch_size else []
        ids = encode_batch(tokenizer, chunk, max_input_length)
        extra = _extra_room(model.config, ids.shape[1], max_extra)
        found = _translate_ids(model, params, ids, options, extra, start)
        outputs += [[Hypothesis(tokenizer.decode(r), sc) for r, sc in row] for row in found[:n]]
    return outputs


def _translate_ids(model, params, ids, options: DecodeOptions, extra: int, first_index: int):
    """Per row of ids [B, S]: [(token ids, score or None), ...] by options.search."""
    if options.search == Search.GREEDY:
        out = generate.translate_greedy(model, params, ids, max_extra=extra)
        return [[(row, None)] for row in np.asarray(out).tolist()]
    if options.search == Search.BEAM:
        seqs, scores = generate.translate_beams(model, params, ids, beam_size=options.beam_size,
                                                alpha=options.alpha, max_extra=extra)
        return _n_best(seqs, scores, options.n_best)
    copies = options.num_samples
    keys = _sample_keys(options.seed, first_index, ids.shape[0], copies)
    out = generate.translate_sample(model, params, np.repeat(ids, copies, axis=0), keys,
                                    temperature=options.temperature, top_k=options.top_k,
                                    top_p=options.top_p, max_extra=extra)
    out = np.asarray(out).reshape(ids.shape[0], copies, -1).tolist()
    return [[(r, None) for r in row] for row in out]


def _n_best(seqs, scores, n_best: int) -> list[list[tuple[list[int], float]]]:
    """The first n_best beams [B, K, L] / [B, K] per row, without empty slots."""
    seqs, scores = np.asarray(seqs)[:, :n_best].tolist(), np.asarray(scores)[:, :n_best].tolist()
    return [[(s, sc) for s, sc in zip(row, row_scores, strict=True) if sc > NEG_INF / 2]
            for row, row_scores in zip(seqs, scores, strict=True)]


def _sample_keys(seed: int, first_index: int, n_inputs: int, copies: int) -> jax.Array:
    """[n_inputs * copies] keys: sample j of input i draws from key(seed) / i / j.

    An input's samples then depend on its index in the whole input, not on the
    batch it is decoded in or on the other inputs.
    """
    index = np.repeat(np.arange(first_index, first_index + n_inputs), copies)
    sample = np.tile(np.arange(copies), n_inputs)
    return _fold_keys(jax.random.key(seed), index, sample)


@jax.jit
def _fold_keys(base, index, sample):
    fold = lambda i, j: jax.random.fold_in(jax.random.fold_in(base, i), j)
    return jax.vmap(fold)(index, sample)


def position_limit(model_config) -> int | None:
    """The most tokens a model can attend over: its learned table's rows, else unbounded."""
    return model_config.max_length if model_config.position_encoding == "learned" else None


def generate_texts(model, params, tokenizer, prompts: Sequence[str], *,
                   max_new_tokens: int = 100, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0) -> list[str]:
    """Continuations of `prompts` by a DecoderOnly model (temperature 0 = greedy)."""
    options = (DecodeOptions(search=Search.GREEDY) if temperature == 0 else
               DecodeOptions(search=Search.SAMPLE, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed))
    found = generate_hypotheses(model, params, tokenizer, prompts, options,
                                max_new_tokens=max_new_tokens, batch_size=max(len(prompts), 1))
    return [h[0].text for h in found]


def generate_hypotheses(model, params, tokenizer, prompts: Sequence[str], options: DecodeOptions,
                        *, max_new_tokens: int = 100,
                        batch_size: int = 64) -> list[list[Hypothesis]]:
    """Continues `prompts` in batches of `batch_size` with any search.

    A model with a learned position table of max_length L cannot attend beyond
    L tokens, so longer greedy or sampled outputs are generated in chunks (see
    `_continue`); beam search needs prompt + max_new_tokens <= L.

    Args:
      model: a DecoderOnly.
      params: its parameters.
      tokenizer: the run's tokenizer.
      prompts: texts to continue (an empty one starts from BOS).
      options: the search (see `decode_options`).
      max_new_tokens: tokens to generate per prompt.
      batch_size: prompts decoded together.

    Raises:
      ValueError: beam search beyond the learned position table.

    Returns:
      per prompt, its n-best beams (best first), its samples, or its greedy output.
    """
    outputs: list[list[Hypothesis]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        rows = [list(tokenizer.encode(p)) or [model.config.pad_id] for p in chunk]
        _check_ids(rows, model.config.vocab_size, chunk)  # as encode_batch: no check in jit
        if options.search == Search.BEAM:
            found = _beam_continue(model, params, rows, max_new_tokens, options)
        else:
            copies = options.num_samples if options.search == Search.SAMPLE else 1
            keys = (None if options.search == Search.GREEDY
                    else _sample_keys(options.seed, start, len(rows), copies))
            new = _continue(model, params, [r for r in rows for _ in range(copies)],
                            max_new_tokens, options, keys)
            found = [[(ids, None) for ids in new[i * copies:(i + 1) * copies]]
                     for i in range(len(rows))]
        outputs += [[Hypothesis(tokenizer.decode(r), sc) for r, sc in row] for row in found]
    return outputs


def _beam_continue(model, params, rows, max_new_tokens: int, options: DecodeOptions):
    """Beam search continuations of token rows: per row [(ids, score), ...]."""
    limit = position_limit(model.config)
    longest = max(len(r) for r in rows)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"beam search needs prompt + max_new_tokens <= max_length={limit} (the "
                         f"learned position table), got {longest} + {max_new_tokens}")
    ids, lengths = _pad_rows(rows, 0, model.config.pad_id)
    seqs, scores = generate.generate_beams(model, params, ids, max_new_tokens=max_new_tokens,
                                           beam_size=options.beam_size, alpha=options.alpha,
                                           prompt_lengths=lengths)
    return _n_best(seqs, scores, options.n_best)


def _continue(model, params, rows, max_new_tokens: int, options: DecodeOptions, keys):
    """Greedy or sampled continuations of token rows: max_new_tokens ids each, cut after EOS.

    Beyond a learned position table of max_length L, outputs are generated in
    chunks of L/4 tokens, each conditioned on the last 3L/4 tokens so far (a
    sliding window, as char-LM samplers crop their context); other position
    schemes generate in one go.
    """
    limit = position_limit(model.config)
    if limit is None or max(len(r) for r in rows) + max_new_tokens <= limit:
        return _generate_ids(model, params, rows, max_new_tokens, options, keys)
    if limit < 4:
        raise ValueError(f"max_length={limit} is too short for windowed generation")
    chunk, context = limit // 4, limit - limit // 4
    outputs: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for i in range(0, max_new_tokens, chunk):
        windows = [(r + o)[-context:] for r, o in zip(rows, outputs, strict=True)]
        n = min(chunk, max_new_tokens - i)
        # Every chunk has the same shapes (windows padded to `context`, `chunk` new
        # ids, the surplus dropped), so one compiled program serves them all.
        chunk_keys = None if keys is None else _fold_chunk(keys, i)
        new = _generate_ids(model, params, windows, chunk, options, chunk_keys, width=context)
        for j, ids in enumerate(new):
            if not done[j]:
                outputs[j] += ids[:n]
                done[j] = model.config.eos_id in ids[:n]
        if all(done):
            break
    return outputs


@jax.jit
def _fold_chunk(keys, offset):
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, offset)


def _pad_rows(rows, width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows right-padded to at least `width` columns [B, P], and their lengths [B]."""
    ids = np.full((len(rows), max(width, *(len(r) for r in rows))), pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, np.array([len(r) for r in rows], np.int32)


def _generate_ids(model, params, rows, n, options: DecodeOptions, keys,
                  width: int = 0) -> list[list[int]]:
    """n new ids per row (cut after EOS); prompts padded to at least `width` columns."""
    ids, lengths = _pad_rows(rows, width, model.config.pad_id)
    greedy = options.search == Search.GREEDY
    out = generate.generate(
        model, params, ids, max_new_tokens=n, greedy=greedy, temperature=options.temperature,
        top_k=options.top_k, top_p=options.top_p, rng=None if greedy else keys,
        prompt_lengths=lengths)
    eos = model.config.eos_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in np.asarray(out).tolist()]


def _extra_room(model_config, width: int, max_extra: int) -> int:
    """Output room beyond the input width; a learned position table caps it."""
    limit = position_limit(model_config)
    return max_extra if limit is None else max(min(max_extra, limit - width), 1)


def score_examples(run, params, limit: int | None = None, examples=None,
                   tag: str = "heldout") -> dict[str, float]:
    """Decodes held-out examples and returns the metric (BLEU + chrF, or exact match).

    Args:
      run: the training Run.
      params: parameters to decode with.
      limit: decode only the first `limit` examples (periodic evaluation);
        None decodes all of them, prints a few and writes TAG.src/.ref/.hyp.
      examples: {"inputs", "targets"} texts; default the run's held-out examples.
      tag: name of the written files and of the printed summary.
    """
    examples = run.input.eval_examples if examples is None else examples
    if not examples or run.task.family != Family.ENCODER_DECODER:
        return {}
    cfg = run.config.decode
    examples = examples[:limit] if limit else examples
    sources = [e["inputs"] for e in examples]
    references = [e["targets"] for e in examples]
    hyps = translate_texts(run.model, params, run.input.tokenizer, sources,
                           beam_size=cfg.beam_size, alpha=cfg.alpha, max_extra=cfg.max_extra,
                           batch_size=cfg.batch_size)
    scores = metric_scores(cfg.metric, hyps, references)
    if limit:
        return scores
    if jax.process_index() == 0:
        for suffix, lines in (("src", sources), ("ref", references), ("hyp", hyps)):
            (run.workdir / f"{tag}.{suffix}").write_text("".join(x + "\n" for x in lines),
                                                        "utf-8")
    for src, hyp, ref in list(zip(sources, hyps, references, strict=True))[: cfg.num_print]:
        print(f"  {src!r} -> {hyp!r}  (reference {ref!r})")
    print(f"{tag} " + "  ".join(f"{k} {v:.4f}" for k, v in scores.items())
          + f"  ({len(examples)} examples)")
    return scores


@dataclasses.dataclass
class LoadedRun:
    """A trained run restored for inference: model, params and tokenizer.

    Use `load_run(workdir)`, then `translate(texts)` (encoder-decoder),
    `generate(prompts)` (decoder-only) or `decode(texts)` (either); texts are
    always a sequence of str (a bare str is a TypeError: pass [text]). All three
    take the same search options (see `decode_options`): search, beam_size,
    alpha, n_best, temperature, top_k, top_p, seed, num_samples. Beam search
    takes the beam_size and alpha not given from the run's own config
    (`decode_preset`), so a restored run decodes as its recipe was scored.
    """

    family: str
    model: Any
    params: Any
    tokenizer: Any
    step: int
    run_config: dict

    def translate(self, texts: Sequence[str], *, max_extra: int = 50, batch_size: int = 64,
                  **options) -> list[str] | list[list[Hypothesis]]:
        """Translations of `texts` (default: the run's own beam search); see `decode`."""
        _check_texts("translate", texts)
        self._check_family("translate", "encoder_decoder")
        return self.decode(texts, max_extra=max_extra, batch_size=batch_size, **options)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int = 100,
                 batch_size: int = 64, **options) -> list[str] | list[list[Hypothesis]]:
        """Continuations of `prompts` (default: greedy); see `decode`."""
        _check_texts("generate", prompts)
        self._check_family("generate", "decoder_only")
        return self.decode(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           **options)

    def decode(self, texts: Sequence[str], *, max_extra: int | None = None,
               max_new_tokens: int | None = None, batch_size: int = 64,
               **options) -> list[str] | list[list[Hypothesis]]:
        """Decodes `texts` with the search that `decode_options(family, **options)` picks.

        Args:
          texts: sources (encoder_decoder) or prompts (decoder_only): a
            sequence of str; a single str is refused (TypeError), pass [text].
          max_extra: encoder_decoder only: at most input length + max_extra
            tokens (default 50).
          max_new_tokens: decoder_only only: tokens to generate (default 100).
          batch_size: inputs decoded together.
          **options: search, beam_size, alpha, n_best, temperature, top_k,
            top_p, seed, num_samples (see `decode_options`; its preset is
            `decode_preset`).

        Returns:
          one text per input, or, with n_best or num_samples > 1, per input its
          list of Hypothesis (n-best: best first, with scores).

        Raises:
          TypeError: `texts` is a single str.
          ValueError: options the search or the family cannot honour, or an
            input longer than the model allows.
        """
        _check_texts("decode", texts)
        chosen = decode_options(self.family, preset=self.decode_preset, **options)
        found = self.hypotheses(texts, chosen, max_extra=max_extra,
                                max_new_tokens=max_new_tokens, batch_size=batch_size)
        return [h[0].text for h in found] if chosen.per_input == 1 else found

    @property
    def decode_preset(self) -> dict:
        """The run's own decode section (beam_size, alpha, ...; {} if it has none)."""
        return dict(self.run_config.get("decode") or {})

    def hypotheses(self, texts: Sequence[str], options: DecodeOptions, *,
                   max_extra: int | None = None, max_new_tokens: int | None = None,
                   batch_size: int = 64) -> list[list[Hypothesis]]:
        """Per input, its list of Hypothesis under `options` (args as in `decode`)."""
        _check_texts("hypotheses", texts)
        _positive("batch_size", batch_size)
        if not get_task(self.family).generates:
            raise ValueError(f"a {self.family} run does not generate")
        if self.family == "encoder_decoder":
            _check_unused("max_new_tokens", max_new_tokens, self.family, "max_extra")
            extra = 50 if max_extra is None else _positive("max_extra", max_extra)
            return translate_hypotheses(self.model, self.params, self.tokenizer, texts, options,
                                        max_extra=extra, batch_size=batch_size,
                                        max_input_length=position_limit(self.model.config))
        _check_unused("max_extra", max_extra, self.family, "max_new_tokens")
        new = 100 if max_new_tokens is None else _positive("max_new_tokens", max_new_tokens)
        return generate_hypotheses(self.model, self.params, self.tokenizer, texts, options,
                                   max_new_tokens=new, batch_size=batch_size)

    def embed(self, texts: Sequence[str], *, batch_size: int = 64,
              normalize: bool = False) -> np.ndarray:
        """Sentence embeddings of an encoder_only run: [len(texts), D] float32.

        The mean of the final hidden states over each text's tokens
        (sentence-transformers' mean pooling, [CLS] and [SEP] included as
        there); normalize: scaled to unit length (cosine similarity = dot).
        `texts` is a sequence of str; a single str is refused (TypeError).
        """
        _check_texts("embed", texts)
        self._check_family("embed", "encoder_only")
        return embed_texts(self.model, self.params, self.tokenizer, texts, batch_size=batch_size,
                           normalize=normalize)

    def _check_family(self, method: str, family: str) -> None:
        if self.family != family:
            raise ValueError(f"{method} needs a {family} run, this one is {self.family}")


def embed_texts(model, params, tokenizer, texts: Sequence[str], *, batch_size: int = 64,
                normalize: bool = False) -> np.ndarray:
    """Mean-pooled final hidden states of an EncoderOnly model, [len(texts), D] (see embed)."""
    _positive("batch_size", batch_size)
    out = []
    for start in range(0, len(texts), batch_size):
        ids = encode_batch(tokenizer, texts[start:start + batch_size],
                           position_limit(model.config))
        out.append(np.asarray(_mean_hidden(model, params, ids)))
    vectors = np.concatenate(out) if out else np.zeros((0, model.config.d_model), np.float32)
    if normalize:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    return vectors


@functools.partial(jax.jit, static_argnums=0)
def _mean_hidden(model, params, ids):
    hidden = model.apply({"params": params}, ids)["hidden"].astype(jnp.float32)
    weights = (ids != model.config.pad_id).astype(jnp.float32)[..., None]
    return (hidden * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)


def _check_unused(name: str, value, family: str, instead: str) -> None:
    if value is not None:
        raise ValueError(f"{name}={value!r} does not apply to {family} runs (use {instead})")


def _check_texts(where: str, texts) -> None:
    """TypeError for one str (or bytes) where a sequence of texts is wanted."""
    if isinstance(texts, str | bytes):
        raise TypeError(f"{where} takes a sequence of texts, got one {type(texts).__name__} "
                        f"{texts[:40]!r}; pass [text] for a single one")


def _check_ids(rows, vocab_size: int, texts) -> None:
    """ValueError naming the first token id outside [0, vocab_size) and its input."""
    for i, r in enumerate(rows):
        bad = [t for t in r if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"input {i} has token id {bad[0]} outside the vocabulary "
                             f"[0, {vocab_size}): {texts[i][:60]!r}")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def load_run(workdir, step: int | None = None, *,
             kernels: Kernels | str = Kernels.PORTABLE) -> LoadedRun:
    """Restores config, parameters (only) and tokenizer of a training run.

    Args:
      workdir: the run's directory (or one `python -m transformer_zoo.train.convert`
        wrote).
      step: the checkpoint step (default: the latest).
      kernels: how the restored model computes: PORTABLE (plain JAX, any
        platform) or CPU (the XLA:CPU layer; `python -m transformer_zoo.train.decode` picks it
        on CPU). The values are the same.

    Raises:
      FileNotFoundError: `workdir` has no checkpoint, no step `step`, or no tokenizer.
    """
    restored = restore_checkpoint(workdir, step, kernels=kernels)
    tokenizer = load_tokenizer(Path(workdir) / "tokenizer")
    return LoadedRun(restored.family, restored.model, restored.params, tokenizer, restored.step,
                     restored.saved["run"])


@dataclasses.dataclass
class Restored:
    """A checkpoint's saved config, its family's model and its parameters."""

    saved: dict
    family: str
    model: Any
    params: Any
    step: int


def restore_checkpoint(workdir, step: int | None = None, *,
                       kernels: Kernels | str = Kernels.PORTABLE) -> Restored:
    """The parameters (only) of a workdir's checkpoint, with its model (args as `load_run`).

    Only what decoding reads (params, config) is verified, checksums included.
    With step=None a damaged newest step is logged (one line) and skipped for
    the newest intact one; nothing is renamed (the workdir may be read-only).
    A step deleted while it is read (a live trainer's retention) is not damage:
    the steps are listed again and the newest one read.

    Raises:
      FileNotFoundError: no checkpoint, or no step `step` (or it was deleted while read).
      ValueError: the step asked for is damaged (names the file), or none is intact.
    """
    workdir = Path(workdir)
    if not (workdir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{workdir} has no checkpoints/ directory: nothing to restore")
    ckpt = Checkpointer(workdir, read_only=True, async_save=False)
    for _ in range(_RELIST_ATTEMPTS):
        steps = ckpt.candidate_steps()
        if not steps:
            raise FileNotFoundError(f"{workdir}/checkpoints holds no complete checkpoint")
        if step is not None and step not in steps:
            raise FileNotFoundError(f"{workdir} has no checkpoint at step {step}; it has {steps}")
        restored = _restore_newest(ckpt, [step] if step is not None else steps[::-1], kernels,
                                   explicit=step is not None)
        if restored is not None:
            return restored
        if step is not None:
            raise FileNotFoundError(f"{workdir} step {step} was deleted while it was being read "
                                    "(the training run's retention removed it)")
        ckpt.reload()  # a trainer is writing and deleting steps: list them again
    raise ValueError(f"{workdir}: every checkpoint was deleted while being read "
                     f"{_RELIST_ATTEMPTS} times in a row; try again")


# How often a decoder lists the steps again when the one it reads is deleted under it.
_RELIST_ATTEMPTS = 5


def _restore_newest(ckpt: Checkpointer, candidates: list[int], kernels, *,
                    explicit: bool) -> Restored | None:
    """The first intact step of `candidates`; None if one was deleted while being read.

    Raises:
      DamagedCheckpointError: the step asked for (`explicit`) is damaged.
      ValueError: no candidate is intact.
    """
    damaged = []
    for candidate in candidates:
        try:
            return _restore_settled(ckpt, candidate, kernels)
        except DamagedCheckpointError as damage:
            if not (ckpt.directory / str(candidate)).is_dir():  # retention, not damage
                log.info("checkpoint step %d was deleted while being read", candidate)
                return None
            if explicit:
                raise
            log.warning("%s; trying an older step", damage)
            damaged.append(f"step {damage.step}: {damage.file}: {damage.reason}")
    raise ValueError(f"{ckpt.directory.parent} holds no intact checkpoint: " + "; ".join(damaged))


# A live trainer finishes a step's files just after committing it and deletes old
# steps file by file: a step that reads as damaged is read once more after this pause.
_SETTLE_SECONDS = 0.2


def _restore_settled(ckpt: Checkpointer, step: int, kernels) -> Restored:
    try:
        return _restore_step(ckpt, step, kernels)
    except DamagedCheckpointError:
        time.sleep(_SETTLE_SECONDS)
        if not (ckpt.directory / str(step)).is_dir():
            raise
        ckpt.reload()
        return _restore_step(ckpt, step, kernels)


def _restore_step(ckpt: Checkpointer, step: int, kernels) -> Restored:
    """Config, model and params of `step`, read through hard links (Checkpointer.pinned)
    so that a trainer deleting the step meanwhile cannot pull its files away; errors
    name the step's own directory, not the links'."""
    with ckpt.pinned(step) as pinned:
        try:
            return _read_step(pinned, step, kernels)
        except DamagedCheckpointError as damage:
            if pinned is ckpt:
                raise
            raise DamagedCheckpointError(ckpt.directory, step, damage.file,
                                         damage.reason) from damage


def _read_step(ckpt: Checkpointer, step: int, kernels) -> Restored:
    saved = ckpt.restore_config(step)
    try:
        model_config = ModelConfig(**saved["model"], kernels=kernels)
        task = get_task(saved["family"])
    except (KeyError, TypeError, ValueError) as err:
        raise DamagedCheckpointError(ckpt.directory, step, "config/metadata",
                                     f"not a run config: {type(err).__name__}: {err}") from err
    model = task.build(model_config)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), **task.dummy_batch()))
    params = ckpt.restore_params(step, meta.unbox(abstract["params"]))
    return Restored(saved, saved["family"], model, params, step)

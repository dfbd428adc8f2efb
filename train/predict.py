"""Text in, text out: decode held-out examples and score them.

Used by the training loop (periodic and final metrics) and by
`python -m transformer_zoo.train.decode`.
Encoder-decoder runs translate with beam search (or greedy with beam_size 1);
the metric is exact match for the synthetic task and sacreBLEU + chrF for
translation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import sacrebleu
from flax.core import meta

from transformer_zoo.data import EOS_ID, PAD_ID, load_tokenizer, normalize_text
from transformer_zoo.models import Kernels, ModelConfig, generate
from transformer_zoo.train.checkpoint import Checkpointer
from transformer_zoo.train.tasks import build_model, dummy_batch

log = logging.getLogger("train")


def encode_batch(tokenizer, texts: Sequence[str], max_length: int | None) -> np.ndarray:
    """Token ids + EOS, right-padded to the longest (rounded up to 8): [B, S] int32.

    Raises:
      ValueError: a text is longer than `max_length` tokens (names its index).
    """
    rows = [list(tokenizer.encode(t)) + [EOS_ID] for t in texts]
    longest = max((len(r) for r in rows), default=1)
    if max_length is not None:
        for i, r in enumerate(rows):
            if len(r) > max_length:
                raise ValueError(f"input {i} has {len(r)} tokens (with EOS); the model allows "
                                 f"{max_length}: {texts[i][:60]!r}")
    width = -(-longest // 8) * 8
    out = np.full((len(rows), width), PAD_ID, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def translate_texts(model, params, tokenizer, texts: Sequence[str], *, beam_size: int = 4,
                    alpha: float = 0.6, max_extra: int = 50, batch_size: int = 64,
                    max_input_length: int | None = None) -> list[str]:
    """Translates `texts` (in batches) and detokenises the best hypotheses."""
    outputs: list[str] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        n = len(chunk)
        chunk += [chunk[-1]] * (batch_size - n) if len(texts) > batch_size else []
        ids = encode_batch(tokenizer, chunk, max_input_length)
        extra = _extra_room(model.config, ids.shape[1], max_extra)
        if beam_size == 1:
            out = generate.translate_greedy(model, params, ids, max_extra=extra, eos_id=EOS_ID)
        else:
            out = generate.translate(model, params, ids, beam_size=beam_size, alpha=alpha,
                                     max_extra=extra, eos_id=EOS_ID)
        out = np.asarray(out)
        outputs += [tokenizer.decode(row.tolist()) for row in out[:n]]
    return outputs


def position_limit(model_config) -> int | None:
    """The most tokens a model can attend over: its learned table's rows, else unbounded."""
    return model_config.max_length if model_config.position_encoding == "learned" else None


def generate_texts(model, params, tokenizer, prompts: Sequence[str], *,
                   max_new_tokens: int = 100, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0) -> list[str]:
    """Continuations of `prompts` by a DecoderOnly model (temperature 0 = greedy).

    A model with a learned position table of max_length L cannot attend beyond
    L tokens, so longer outputs are generated in chunks of L/4 tokens, each
    conditioned on the last 3L/4 tokens so far (a sliding window, as char-LM
    samplers crop their context); other position schemes generate in one go.
    """
    rows = [list(tokenizer.encode(p)) or [PAD_ID] for p in prompts]
    limit = position_limit(model.config)
    if limit is None or max(len(r) for r in rows) + max_new_tokens <= limit:
        new = _generate_ids(model, params, rows, max_new_tokens, temperature, top_k, top_p, seed)
        return [tokenizer.decode(r) for r in new]
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
        new = _generate_ids(model, params, windows, chunk, temperature, top_k, top_p, seed + i,
                            width=context)
        for j, ids in enumerate(new):
            if not done[j]:
                outputs[j] += ids[:n]
                done[j] = EOS_ID in ids[:n]
        if all(done):
            break
    return [tokenizer.decode(o) for o in outputs]


def _generate_ids(model, params, rows, n, temperature, top_k, top_p, seed,
                  width: int = 0) -> list[list[int]]:
    """n new ids per row (cut after EOS); prompts padded to at least `width` columns."""
    ids = np.zeros((len(rows), max(width, *(len(r) for r in rows))), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    out = generate.generate(
        model, params, ids, max_new_tokens=n, greedy=temperature == 0,
        temperature=max(temperature, 1e-6), top_k=top_k, top_p=top_p,
        rng=jax.random.key(seed), eos_id=EOS_ID,
        prompt_lengths=np.array([len(r) for r in rows], np.int32))
    result = []
    for row in np.asarray(out).tolist():
        result.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return result


def _extra_room(model_config, width: int, max_extra: int) -> int:
    """Output room beyond the input width; a learned position table caps it."""
    limit = position_limit(model_config)
    return max_extra if limit is None else max(min(max_extra, limit - width), 1)


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Share of hypotheses equal to their reference after whitespace normalisation."""
    pairs = list(zip(hypotheses, references, strict=True))
    return sum(normalize_text(h) == normalize_text(r) for h, r in pairs) / max(len(pairs), 1)


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """sacreBLEU (13a, cased) and chrF on detokenised text."""
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [list(references)]).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, [list(references)]).score}


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
    if not examples or run.config.family != "encoder_decoder":
        return {}
    cfg = run.config.decode
    examples = examples[:limit] if limit else examples
    sources = [e["inputs"] for e in examples]
    references = [e["targets"] for e in examples]
    hyps = translate_texts(run.model, params, run.input.tokenizer, sources,
                           beam_size=cfg.beam_size, alpha=cfg.alpha, max_extra=cfg.max_extra,
                           batch_size=cfg.batch_size)
    scores = (bleu_chrf(hyps, references) if cfg.metric == "bleu"
              else {"exact_match": exact_match(hyps, references)})
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



def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Exact match, sacreBLEU and chrF."""
    return {"exact_match": exact_match(hypotheses, references), **bleu_chrf(hypotheses, references)}


@dataclasses.dataclass
class LoadedRun:
    """A trained run restored for inference: model, params and tokenizer.

    Use `load_run(workdir)`, then `translate(texts)` (encoder-decoder) or
    `generate(prompts)` (decoder-only).
    """

    family: str
    model: Any
    params: Any
    tokenizer: Any
    step: int
    run_config: dict

    def translate(self, texts: Sequence[str], *, beam_size: int = 4, alpha: float = 0.6,
                  max_extra: int = 50, batch_size: int = 64) -> list[str]:
        if self.family != "encoder_decoder":
            raise ValueError(f"translate needs an encoder_decoder run, this one is {self.family}")
        return translate_texts(self.model, self.params, self.tokenizer, texts,
                               beam_size=beam_size, alpha=alpha, max_extra=max_extra,
                               batch_size=batch_size,
                               max_input_length=position_limit(self.model.config))

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int = 100,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> list[str]:
        """Continuations of `prompts` (temperature 0 = greedy); see generate_texts."""
        if self.family != "decoder_only":
            raise ValueError(f"generate needs a decoder_only run, this one is {self.family}")
        return generate_texts(self.model, self.params, self.tokenizer, prompts,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed)



def load_run(workdir, step: int | None = None, *,
             kernels: Kernels | str = Kernels.PORTABLE) -> LoadedRun:
    """Restores config, parameters (only) and tokenizer of a training run.

    Args:
      workdir: the run's directory.
      step: the checkpoint step (default: the latest).
      kernels: how the restored model computes: PORTABLE (plain JAX, any
        platform) or CPU (the XLA:CPU layer; `python -m transformer_zoo.train.decode` picks it
        on CPU). The values are the same.

    Raises:
      FileNotFoundError: `workdir` has no checkpoint, or no step `step`.
    """
    workdir = Path(workdir)
    if not (workdir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{workdir} has no checkpoints/ directory: nothing to restore")
    ckpt = Checkpointer(workdir, read_only=True, async_save=False)
    steps = ckpt.all_steps()
    if not steps:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no complete checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"{workdir} has no checkpoint at step {step}; it has {steps}")
    saved = ckpt.restore_config(step)
    model_config = ModelConfig(**saved["model"], kernels=kernels)
    model = build_model(saved["family"], model_config)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), **dummy_batch(saved["family"])))
    params = ckpt.restore_params(step, meta.unbox(abstract["params"]))
    tokenizer = load_tokenizer(workdir / "tokenizer")
    return LoadedRun(saved["family"], model, params, tokenizer, step, saved["run"])

r"""python -m transformer_zoo.train.inspect: a trained run's attention, positions and curves.

    python -m transformer_zoo.train.inspect --workdir DIR --text "..." [--target "..."]
        [--out DIR] [--step N] [--layer L]

Restores the run (the latest checkpoint, or --step), tokenizes --text with the
run's tokenizer (+ its EOS), runs one forward pass capturing every attention
weight (models/capture.py) and writes PNGs into --out (default WORKDIR/inspect):

  encoder_self_attention.png  layers x heads, source x source (encoder_decoder, encoder_only)
  decoder_self_attention.png  layers x heads over the decoder input, BOS + target
                              (encoder_decoder, decoder_only)
  cross_attention.png         layers x heads, target x source (encoder_decoder)
  alignment.png               target x source: decoder layer --layer (default the last),
                              averaged over heads (encoder_decoder)
  positions_*.png             the run's position encoding, and positions_explained.png
                              with all four (plots.position_pictures)
  curves.png                  loss, accuracy, learning rate, BLEU/chrF or exact match
                              (from WORKDIR/metrics.jsonl, when it has rows to plot)

Encoder-decoder runs translate --text greedily and inspect the translation,
unless --target gives the target; decoder-only runs read --text as the prompt;
encoder-only runs as the input. Decoder rows are the tokens the decoder reads
(BOS, then the target shifted right: teacher forcing); alignment rows are the
target tokens those positions predict. Prints one line per file written (its path).

Errors (a missing workdir or checkpoint, an empty --text, a text or target longer
than the model allows, --target for a run that does not translate, a --layer the
decoder does not have) exit 1, print one line on stderr and write nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from absl import flags

from transformer_zoo.models import capture_attention, generate, shift_right
from transformer_zoo.train import plots
from transformer_zoo.train.cli import one_line, run_command
from transformer_zoo.train.predict import load_run, position_limit

PROG = "python -m transformer_zoo.train.inspect"
log = logging.getLogger("train")
MAX_EXTRA = 50  # greedy translations are at most source length + MAX_EXTRA tokens


def define_flags(fv: flags.FlagValues) -> None:
    """Declares the inspect flags on `fv`."""
    kw = {"flag_values": fv}
    flags.DEFINE_string("workdir", None, "Run directory with checkpoints/.", **kw)
    flags.DEFINE_string("text", None, "The sentence (translation, encoder-only) or prompt "
                        "(decoder-only) to look at.", **kw)
    flags.DEFINE_string("target", None, "Encoder-decoder: the target to attend with instead "
                        "of the greedy translation.", **kw)
    flags.DEFINE_string("out", None, "Folder of the PNGs (default WORKDIR/inspect).", **kw)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", **kw)
    flags.DEFINE_integer("layer", None, "Decoder layer of alignment.png (default the last; "
                         "negative counts from the end).", **kw)
    flags.mark_flags_as_required(["workdir", "text"], flag_values=fv)


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id as its own piece, for tick labels.

    The tokenizer's `id_to_token` when it has one (Hugging Face vocabularies keep
    "##" and "Ġ" markers), else `decode` of the single id; special ids that decode
    to nothing are named (<pad>, </s>, <s>), other empty pieces shown as <id>.
    """
    special = {tokenizer.pad_id: "<pad>", tokenizer.eos_id: "</s>", tokenizer.bos_id: "<s>"}
    pieces = []
    for i in map(int, ids):
        piece = tokenizer.id_to_token(i) if hasattr(tokenizer, "id_to_token") else None
        if piece is None:
            piece = special.get(i) or tokenizer.decode([i]) or f"<{i}>"
        pieces.append(piece)
    return pieces


@dataclasses.dataclass
class Inspection:
    """One example's captured attention and the tokens along its axes.

    Attributes:
      family: the run's family.
      tokens: "source" (encoder input), "decoder" (what the decoder reads: BOS +
        target shifted right) and "target" (what each decoder position predicts),
        those the family has.
      weights: {module path: [N, T, S] float32} (capture_attention's, batch row 0).
    """

    family: str
    tokens: dict[str, list[str]]
    weights: dict[str, np.ndarray]


def _encode(tokenizer, text: str, limit: int | None, flag: str) -> np.ndarray:
    """[1, L] ids of `text` + EOS; ValueError when empty or beyond `limit` tokens."""
    if not text.strip():
        raise ValueError(f"--{flag} is empty: give a text to look at")
    ids = list(tokenizer.encode(text)) + [tokenizer.eos_id]
    if limit is not None and len(ids) > limit:
        raise ValueError(f"--{flag} has {len(ids)} tokens (with EOS); the model allows {limit} "
                         f"(max_length of its learned positions): {text[:60]!r}")
    return np.asarray([ids], np.int32)


def _translate(model, params, source: np.ndarray, limit: int | None) -> np.ndarray:
    """[1, T] greedy translation of source [1, S], up to and with its EOS."""
    width = source.shape[1]
    extra = MAX_EXTRA if limit is None else max(min(MAX_EXTRA, limit - width), 1)
    row = np.asarray(generate.translate_greedy(model, params, source, max_extra=extra))[0]
    row = row[:limit] if limit is not None else row
    eos = np.flatnonzero(row == model.config.eos_id)
    return row[None, : eos[0] + 1 if eos.size else len(row)]


# One compiled forward pass instead of hundreds of dispatched operations.
_capture = jax.jit(capture_attention, static_argnums=0)


def inspect_text(model, params, tokenizer, family: str, text: str,
                 target: str | None = None) -> Inspection:
    """Captures the attention of one example (see the module docstring for the families).

    Args:
      model: the run's model (EncoderDecoder, DecoderOnly or EncoderOnly).
      params: its parameters.
      tokenizer: the run's tokenizer.
      family: "encoder_decoder", "decoder_only" or "encoder_only".
      text: the source, prompt or input.
      target: encoder_decoder only: the target (default: the greedy translation).

    Raises:
      ValueError: an empty text or target, one longer than the model allows, or a
        target for another family.
    """
    limit = position_limit(model.config)
    if target is not None and family != "encoder_decoder":
        raise ValueError(f"--target applies to encoder_decoder runs only; this run is {family}")
    ids = _encode(tokenizer, text, limit, "text")
    tokens = {}
    if family == "encoder_decoder":
        targets = (_translate(model, params, ids, limit) if target is None
                   else _encode(tokenizer, target, limit, "target"))
        args = (ids, targets)
        tokens["source"] = token_pieces(tokenizer, ids[0])
    elif family == "decoder_only":
        targets, args = ids, (ids,)
    else:
        args = (ids,)
        tokens["source"] = token_pieces(tokenizer, ids[0])
    if family != "encoder_only":
        reads = np.asarray(shift_right(targets, model.config.bos_id))[0]
        tokens["decoder"] = token_pieces(tokenizer, reads)
        tokens["target"] = token_pieces(tokenizer, targets[0])
    weights, _ = _capture(model, params, *args)
    return Inspection(family, tokens, {k: np.asarray(w[0]) for k, w in weights.items()})


def _stacked(inspection: Inspection, prefix: str, suffix: str) -> np.ndarray | None:
    """[L, N, T, S] of the modules "PREFIX/layer_i/SUFFIX", in layer order (None if none)."""
    found = [w for name, w in inspection.weights.items()
             if name.startswith(f"{prefix}/") and name.endswith(f"/{suffix}")]
    return np.stack(found) if found else None


# file stem -> (module path prefix, attention, query tokens, key tokens, title)
GRIDS = {
    "encoder_self_attention": ("encoder", "self_attention", "source", "source",
                               "encoder self-attention"),
    "decoder_self_attention": ("decoder", "self_attention", "decoder", "decoder",
                               "decoder self-attention"),
    "cross_attention": ("decoder", "cross_attention", "target", "source", "cross-attention"),
}


def write_attention(inspection: Inspection, out_dir, layer: int | None = None,
                    title: str = "") -> list[Path]:
    """Writes the attention grids and the alignment (see the module docstring).

    Args:
      inspection: what `inspect_text` captured.
      out_dir: the folder to write into.
      layer: decoder layer of alignment.png (default the last; negative from the end).
      title: appended to each figure's title (e.g. the run and step).

    Returns:
      the paths written.

    Raises:
      ValueError: `layer` is not a decoder layer (before anything is written).
    """
    pictures = {stem: (_stacked(inspection, prefix, suffix), spec)
                for stem, (prefix, suffix, *spec) in GRIDS.items()}
    cross = pictures["cross_attention"][0]
    if cross is not None:
        n = cross.shape[0]
        chosen = n - 1 if layer is None else layer
        if not -n <= chosen < n:
            raise ValueError(f"--layer={layer} is out of range: the decoder has {n} "
                             f"layer{'s' * (n != 1)}")
        chosen %= n
    out_dir = Path(out_dir)
    written = []
    for stem, (weights, (q_name, k_name, name)) in pictures.items():
        if weights is not None:
            written.append(plots.attention_grid(
                weights, inspection.tokens[q_name], inspection.tokens[k_name],
                out_dir / f"{stem}.png", f"{name} {title}".strip()))
    if cross is not None:
        written.append(plots.alignment(
            cross[chosen].mean(0), inspection.tokens["source"], inspection.tokens["target"],
            out_dir / "alignment.png",
            f"cross-attention, decoder layer {chosen}, mean over heads {title}".strip()))
    return written


def run(fv: flags.FlagValues) -> list[Path]:
    """Inspects --text as the flags say; returns the paths written."""
    workdir = Path(fv.workdir)
    if not workdir.is_dir():
        raise FileNotFoundError(f"--workdir={workdir} does not exist")
    if not fv.text.strip():
        raise ValueError("--text is empty: give a text to look at")
    loaded = load_run(workdir, fv.step)
    inspection = inspect_text(loaded.model, loaded.params, loaded.tokenizer, loaded.family,
                              fv.text, fv.target)
    out = Path(fv.out) if fv.out else workdir / "inspect"
    # Attention first: it checks --layer before anything is written.
    written = write_attention(inspection, out, fv.layer, f"(step {loaded.step})")
    written += plots.position_pictures(loaded.model.config, out)
    metrics = workdir / "metrics.jsonl"
    if metrics.is_file():
        try:
            written.append(plots.training_curves(metrics, out / "curves.png"))
        except ValueError as err:  # a run stopped before its first log line: no curves yet
            log.warning("no curves.png: %s", one_line(err))
    for path in written:
        print(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `argv` without the program name (default sys.argv[1:]); returns the code."""
    return run_command(PROG, __doc__, define_flags, run, argv)


if __name__ == "__main__":
    sys.exit(main())

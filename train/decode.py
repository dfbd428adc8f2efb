r"""python -m transformer_zoo.train.decode: restore a run's parameters, decode, score.

    python -m transformer_zoo.train.decode --workdir DIR [--step N] --input FILE|- [--output FILE]
        [--search greedy|beam|sample]
        [--beam_size 4 --alpha 0.6 --n_best K]
        [--temperature T --top_k K --top_p P --seed S --num_samples N]
        [--max_extra 50 (encoder-decoder) | --max_new_tokens 100 (decoder-only)]
        [--batch_size 64] [--reference FILE]

Encoder-decoder runs translate each input line, decoder-only runs continue it
as a prompt; both families take every search (predict.decode_options). Without
--search, a sampling option (--temperature > 0, --top_k, --top_p,
--num_samples) means sampling, a beam option (--beam_size, --alpha, --n_best)
beam search, --temperature 0 or --beam_size 1 alone greedy; with none of them
encoder-decoder runs decode as their recipe was scored (its config's
decode.beam_size and decode.alpha; greedy if that beam_size is 1) and
decoder-only runs greedily. Beam search takes the --beam_size and --alpha not
given from the run's config too (beam 4, alpha 0.6 in the paper's recipes).
An option that the search or the run's family cannot honour (say --temperature
with --search beam, --n_best above --beam_size, --seed without sampling,
--max_new_tokens on an encoder-decoder run) is an error.

Output: one line per input. With --n_best K > 1, K lines per input (fewer if
the search finished fewer), best first: INDEX TAB RANK TAB SCORE TAB TEXT, where
INDEX is the input's 0-based line, RANK 1 is the best and SCORE is
log P / ((5 + |Y|) / 6)^alpha. With --num_samples N > 1, N lines per input:
INDEX TAB SAMPLE TAB TEXT (SAMPLE from 1). In these two formats, backslash, tab
and newline in TEXT are written as \\, \t and \n. Sample j of input line i
depends only on --seed, i and j (not on --batch_size).

With --reference (one output per input), prints exact match, sacreBLEU and chrF
on stderr. Errors (bad or conflicting flags, no checkpoint, unknown step, input
too long) exit with code 1, print one line on stderr and write nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import jax
from absl import flags

from transformer_zoo.train.cli import run_command
from transformer_zoo.train.parallel import kernels_for
from transformer_zoo.train.predict import DecodeOptions, Search, decode_options, load_run
from transformer_zoo.train.scores import score

PROG = "python -m transformer_zoo.train.decode"
_SEARCH_FLAGS = ("beam_size", "alpha", "n_best", "temperature", "top_k", "top_p", "seed",
                 "num_samples")


def define_flags(fv: flags.FlagValues) -> None:
    """Declares the decode flags on `fv` (None = not given: see predict.decode_options)."""
    kw = {"flag_values": fv}
    flags.DEFINE_string("workdir", None, "Run directory with checkpoints/.", **kw)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", **kw)
    flags.DEFINE_string("input", None, "One sentence or prompt per line; - = stdin.", **kw)
    flags.DEFINE_string("output", None, "Output file (default: stdout).", **kw)
    flags.DEFINE_string("reference", None, "References, one per line: prints exact match, "
                        "sacreBLEU and chrF on stderr.", **kw)
    flags.DEFINE_enum("search", None, [s.value for s in Search], "Search (default: from the "
                      "options given, else beam for encoder-decoder, greedy for decoder-only).",
                      **kw)
    flags.DEFINE_integer("beam_size", None, "Beam search: beams per input (default: the "
                         "run's decode.beam_size).", **kw)
    flags.DEFINE_float("alpha", None, "Beam search: length penalty exponent (default: the "
                       "run's decode.alpha).", **kw)
    flags.DEFINE_integer("n_best", None, "Beam search: write the K best beams per input "
                         "(default 1, at most --beam_size).", **kw)
    flags.DEFINE_float("temperature", None, "Sampling temperature (default 1; 0 = greedy).", **kw)
    flags.DEFINE_integer("top_k", None, "Sampling among the k most likely tokens (0 = all).", **kw)
    flags.DEFINE_float("top_p", None, "Sampling within the nucleus of this mass (1 = all).", **kw)
    flags.DEFINE_integer("seed", None, "Sampling seed (default 0).", **kw)
    flags.DEFINE_integer("num_samples", None, "Sampling: samples per input (default 1).", **kw)
    flags.DEFINE_integer("max_extra", None, "Encoder-decoder: output <= input length + this "
                         "(default 50).", **kw)
    flags.DEFINE_integer("max_new_tokens", None, "Decoder-only: tokens to generate (default "
                         "100).", **kw)
    flags.DEFINE_integer("batch_size", 64, "Inputs decoded together.", lower_bound=1, **kw)
    flags.mark_flags_as_required(["workdir", "input"], flag_values=fv)


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return [line.rstrip("\n") for line in sys.stdin]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file {p} does not exist")
    return p.read_text(encoding="utf-8").splitlines()


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def format_outputs(found, options: DecodeOptions) -> str:
    """The output file's text (see the module docstring for the formats)."""
    if options.per_input == 1:
        return "".join(hyps[0].text + "\n" for hyps in found)
    lines = []
    for i, hyps in enumerate(found):
        for j, h in enumerate(hyps, start=1):
            middle = f"{j}\t{h.score:.4f}" if options.search == Search.BEAM else f"{j}"
            lines.append(f"{i}\t{middle}\t{_escape(h.text)}\n")
    return "".join(lines)


def run(fv: flags.FlagValues) -> list[str]:
    """Decodes --input as the flags say; returns the lines written."""
    given = {name: fv[name].value for name in _SEARCH_FLAGS}
    if fv.reference and ((given["n_best"] or 1) > 1 or (given["num_samples"] or 1) > 1):
        raise ValueError("--reference scores one output per input; it does not combine with "
                         f"--n_best={given['n_best']} or --num_samples={given['num_samples']}")
    lines = _read_lines(fv.input)
    references = _read_lines(fv.reference) if fv.reference else None
    if references is not None and len(references) != len(lines):
        raise ValueError(f"--reference has {len(references)} lines, --input has {len(lines)}")
    # The XLA:CPU layer where jax computes on CPUs (the same values, faster there).
    loaded = load_run(fv.workdir, fv.step, kernels=kernels_for(jax.devices()))
    options = decode_options(loaded.family, preset=loaded.decode_preset, search=fv.search,
                             **given)
    found = loaded.hypotheses(lines, options, max_extra=fv.max_extra,
                              max_new_tokens=fv.max_new_tokens, batch_size=fv.batch_size)
    text = format_outputs(found, options)
    if fv.output:
        Path(fv.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    if references is not None:
        outputs = [hyps[0].text for hyps in found]
        scores = score(outputs, references)
        print(f"step {loaded.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in scores.items())
              + f"  ({len(lines)} lines)", file=sys.stderr)
    return text.splitlines()


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `argv` without the program name (default sys.argv[1:]); returns the code."""
    return run_command(PROG, __doc__, define_flags, run, argv)


if __name__ == "__main__":
    sys.exit(main())

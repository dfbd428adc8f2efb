"""The decoding options of every front-end: which search, and its settings.

`decode_options` turns what a caller gave (search, beam_size, alpha, n_best,
temperature, top_k, top_p, seed, num_samples) into a validated `DecodeOptions`
for greedy decoding, beam search or sampling, refusing any option the search
or the model family cannot honour, so no option is ever silently ignored.
train/predict.py decodes with them; load_run(...) and the decode CLI build them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

from transformer_zoo.models.decoding import check_sampling
from transformer_zoo.models.variants import parse
from transformer_zoo.train.tasks import TASKS


class Search(enum.StrEnum):
    """How outputs are searched for; every family that generates supports all three."""

    GREEDY = "greedy"  # argmax at every step
    BEAM = "beam"  # beam search with the GNMT length penalty; n-best lists
    SAMPLE = "sample"  # ancestral sampling with temperature, top-k, top-p; several samples


GENERATING_FAMILIES = tuple(family.value for family, task in TASKS.items() if task.generates)

# The options each search uses (their defaults are DecodeOptions').
_BEAM_OPTIONS = ("beam_size", "alpha", "n_best")
_SAMPLE_OPTIONS = ("temperature", "top_k", "top_p", "seed", "num_samples")
_OPTIONS = {Search.GREEDY: (), Search.BEAM: _BEAM_OPTIONS, Search.SAMPLE: _SAMPLE_OPTIONS}
# Values that change nothing where the option has no role (temperature 0 = greedy).
_NEUTRAL = {"beam_size": 1, "n_best": 1, "num_samples": 1}
_INTS = ("beam_size", "n_best", "top_k", "seed", "num_samples")
_PRESET = ("beam_size", "alpha")  # what a run's own decode section sets for beam search


class Hypothesis(NamedTuple):
    """One output for an input."""

    text: str
    score: float | None  # beam search: log P(Y|X) / lp(|Y|); greedy and samples: None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """A search and its settings, validated at construction (ValueError).

    `decode_options` builds one from the options a caller gave, refusing those
    the search does not use.
    """

    search: Search
    beam_size: int = 4
    alpha: float = 0.6
    n_best: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1

    def __post_init__(self):
        object.__setattr__(self, "search", parse(Search, self.search, "search"))
        _check_types({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                      if f.name != "search"})
        _check_values(self)

    @property
    def per_input(self) -> int:
        """How many outputs each input gets (up to: n-best lists skip empty beams)."""
        return {Search.BEAM: self.n_best, Search.SAMPLE: self.num_samples}.get(self.search, 1)


def decode_options(family: str, *, preset: Mapping[str, Any] | None = None,
                   search: Search | str | None = None,
                   beam_size: int | None = None, alpha: float | None = None,
                   n_best: int | None = None, temperature: float | None = None,
                   top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                   num_samples: int | None = None) -> DecodeOptions:
    """The search for `family` from the options given (None = not given).

    Without `search`: sampling if a sampling option is given (temperature > 0,
    top_k, top_p, num_samples), beam search if a beam option is (beam_size,
    alpha, n_best), greedy for temperature 0 or beam_size 1 alone (today's
    spellings of greedy), else the family's default: beam search (beam 4,
    alpha 0.6) for encoder_decoder, greedy for decoder_only. `seed` alone asks
    for nothing (with any search but sampling it is an error).

    `preset` holds a run's own beam settings (its config's decode section:
    beam_size, alpha; other keys are ignored), so that a restored run decodes
    the way its recipe was scored: beam search takes the beam_size and alpha
    not given from it (a preset beam_size of 1 keeps the default 4), and an
    encoder_decoder run given no option at all decodes with it (greedy for a
    preset beam_size of 1).

    Raises:
      ValueError: an unknown family or search; an option the search does not
        use (beam_size 1, n_best 1 and num_samples 1 change nothing and pass,
        temperature 0 passes with greedy); beam and sampling options mixed
        without `search`; an out-of-range value (e.g. n_best > beam_size).
    """
    if family not in GENERATING_FAMILIES:
        raise ValueError(f"family={family!r} does not generate; decoding needs one of "
                         f"{list(GENERATING_FAMILIES)}")
    given = dict(beam_size=beam_size, alpha=alpha, n_best=n_best, temperature=temperature,
                 top_k=top_k, top_p=top_p, seed=seed, num_samples=num_samples)
    given = {k: v for k, v in given.items() if v is not None}
    _check_types(given)
    preset = _preset(preset)
    if search is None and not given and family == "encoder_decoder" and preset.get(
            "beam_size") == 1:
        search = Search.GREEDY  # the recipe decodes greedily
    search = _infer_search(family, given) if search is None else parse(Search, search, "search")
    for name, value in given.items():
        neutral = _NEUTRAL.get(name) == value or (name, value, search) == (
            "temperature", 0, Search.GREEDY)
        if name not in _OPTIONS[search] and not neutral:
            kind = "a beam search" if name in _BEAM_OPTIONS else "a sampling"
            raise ValueError(f"{name}={value!r} does not apply to search={search.value} "
                             f"({kind} option)")
    if search == Search.BEAM:
        given = {k: v for k, v in preset.items() if not (k == "beam_size" and v == 1)} | given
    return DecodeOptions(search=search, **{k: v for k, v in given.items() if k in _OPTIONS[search]})


def _preset(preset: Mapping[str, Any] | None) -> dict[str, Any]:
    """The beam settings of a run's decode section (validated: ValueError names the value)."""
    found = {k: preset[k] for k in _PRESET if preset and preset.get(k) is not None}
    try:
        _check_types(found)
        if found:
            DecodeOptions(search=Search.BEAM, **found)
    except ValueError as e:
        raise ValueError(f"the run's decode settings {found} are not a valid beam search: "
                         f"{e}") from None
    return found


def _check_types(given: dict) -> None:
    for name, value in given.items():
        ok = isinstance(value, int) if name in _INTS else isinstance(value, int | float)
        if not ok or isinstance(value, bool):
            kind = "an int" if name in _INTS else "a number"
            raise ValueError(f"{name} must be {kind}, got {value!r}")


def _infer_search(family: str, given: dict) -> Search:
    """The search the given options ask for (see `decode_options`)."""
    asks: dict[Search, str] = {}  # search -> the first option asking for it
    for name, value in given.items():
        if (name, value) == ("temperature", 0):
            asks.setdefault(Search.GREEDY, name)
        elif name in _SAMPLE_OPTIONS and name != "seed":
            asks.setdefault(Search.SAMPLE, name)
        elif name in _BEAM_OPTIONS:
            asks.setdefault(Search.BEAM, name)
    if Search.BEAM in asks and given.get("beam_size") == 1 and given.get("n_best", 1) == 1:
        asks.setdefault(Search.GREEDY, asks.pop(Search.BEAM))
    if len(asks) > 1:
        (a, x), (b, y) = list(asks.items())[:2]
        raise ValueError(f"{x}={given[x]!r} asks for search={a.value} and {y}={given[y]!r} for "
                         f"search={b.value}; choose one with search=")
    if asks:
        return next(iter(asks))
    return Search.BEAM if family == "encoder_decoder" else Search.GREEDY


def _check_values(o: DecodeOptions) -> None:
    if o.search == Search.BEAM:
        if o.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {o.beam_size}")
        if o.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {o.alpha}")
        if not 1 <= o.n_best <= o.beam_size:
            raise ValueError(f"n_best must be in [1, beam_size={o.beam_size}], got {o.n_best}")
    if o.search == Search.SAMPLE:
        check_sampling(o.temperature, o.top_k, o.top_p)
        if o.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {o.num_samples}")



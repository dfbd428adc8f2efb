"""How decoded text is scored against references: the `DecodeMetric` family.

sacreBLEU (13a tokenisation, cased, on detokenised text) with chrF for
translation; exact match (after whitespace normalisation) for the synthetic tasks.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import sacrebleu

from transformer_zoo.data import normalize_text
from transformer_zoo.models.variants import parse


class DecodeMetric(enum.StrEnum):
    """The metric a run decodes held-out data for (the config's decode.metric)."""

    BLEU = "bleu"  # corpus sacreBLEU, reported with chrF
    EXACT_MATCH = "exact_match"  # share of outputs equal to their reference


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Share of hypotheses equal to their reference after whitespace normalisation."""
    pairs = list(zip(hypotheses, references, strict=True))
    return sum(normalize_text(h) == normalize_text(r) for h, r in pairs) / max(len(pairs), 1)


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """sacreBLEU (13a, cased) and chrF on detokenised text."""
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [list(references)]).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, [list(references)]).score}


def metric_scores(metric: DecodeMetric | str, hypotheses: Sequence[str],
                  references: Sequence[str]) -> dict[str, float]:
    """The scores of `metric`: {"bleu", "chrf"} or {"exact_match"}."""
    metric = parse(DecodeMetric, metric, "decode.metric")
    if metric == DecodeMetric.BLEU:
        return bleu_chrf(hypotheses, references)
    return {"exact_match": exact_match(hypotheses, references)}


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Every score: exact match, sacreBLEU and chrF."""
    return {"exact_match": exact_match(hypotheses, references), **bleu_chrf(hypotheses, references)}

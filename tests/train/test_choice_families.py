"""The training and data choice families are StrEnums, validated where they enter.

Each public entry point takes a member or its exact value and refuses anything else
with a ValueError that names the field, the value and the choices (a misspelt value
used to pass silently: Checkpointer(best_mode="mx") acted as "max").
"""

import enum

import pytest
from ml_collections import ConfigDict

from transformer_zoo.data import Batching, BatchMode, SpmModelType, train_sentencepiece
from transformer_zoo.train import BestMode, DecodeMetric, Optimizer, Schedule
from transformer_zoo.train.checkpoint import Checkpointer
from transformer_zoo.train.schedules import make_schedule
from transformer_zoo.train.scores import metric_scores
from transformer_zoo.train.state import make_optimizer


def _optim(**overrides) -> ConfigDict:
    return ConfigDict(dict(name="adam", b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0,
                           schedule="constant", learning_rate=1e-3, end_learning_rate=0.0,
                           warmup_steps=10, clip_norm=0.0, grad_accum_steps=1) | overrides)


def _batching(mode):
    return Batching(mode=mode, batch_size=2, max_inputs_length=8, max_targets_length=8)


def _schedule(name):
    return make_schedule(name, d_model=8, peak=1.0, warmup_steps=10, total_steps=100)


def _optimizer(name):
    return make_optimizer(_optim(name=name), d_model=8, total_steps=100)


def _scores(metric):
    scores = metric_scores(metric, ["Ein Hund läuft ."], ["Ein Hund läuft ."])
    expected = {"exact_match": 1.0} if metric == "exact_match" else {"bleu": 100.0, "chrf": 100.0}
    assert scores == pytest.approx(expected), scores


def _checkpointer(tmp_path):
    def build(mode):
        return Checkpointer(tmp_path / str(mode), best_metric="loss", best_mode=mode,
                            async_save=False)
    return build


def _spm(tmp_path):
    def build(kind):
        texts = [f"sentence number {i} with words" for i in range(50)]
        return train_sentencepiece(texts, tmp_path / str(kind), vocab_size=30, model_type=kind)
    return build


CASES = [
    ("batching", lambda tmp: _batching, "Batching.mode", BatchMode),
    ("schedule", lambda tmp: _schedule, "optim.schedule", Schedule),
    ("optimizer", lambda tmp: _optimizer, "optim.name", Optimizer),
    ("metric", lambda tmp: _scores, "decode.metric", DecodeMetric),
    ("checkpointer", _checkpointer, "Checkpointer best_mode", BestMode),
    ("sentencepiece", _spm, "model_type", SpmModelType),
]


@pytest.mark.parametrize("make,field,kind", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_members_and_values_are_accepted_and_others_refused(tmp_path, make, field, kind):
    assert issubclass(kind, enum.StrEnum)
    build = make(tmp_path)
    for member in kind:
        build(member.value)
    good = next(iter(kind)).value
    choices = str([member.value for member in kind]).replace("[", r"\[").replace("]", r"\]")
    for bad in (good.upper(), "nope"):
        with pytest.raises(ValueError, match=rf"{field}='{bad}' is unknown; choose from {choices}"):
            build(bad)


def test_a_batching_mode_is_stored_as_its_member():
    assert _batching("bucket").mode is BatchMode.BUCKET
    assert _batching(BatchMode.PACK).mode is BatchMode.PACK


def test_a_bad_best_mode_creates_no_directory(tmp_path):
    with pytest.raises(ValueError, match="best_mode='mx' is unknown"):
        Checkpointer(tmp_path / "b", best_metric="bleu", best_mode="mx", async_save=False)
    assert not (tmp_path / "b").exists()

"""A pre-stage (train/stages.py): one command equals the two runs it stands for,
a finished pre-stage is not trained again, and bad overrides fail before any work."""

import json

import jax
import ml_collections
import numpy as np
import pytest

from tests.train import tiny_config
from transformer_zoo.train.checkpoint import Checkpointer
from transformer_zoo.train.loop import train_and_evaluate
from transformer_zoo.train.predict import load_run
from transformer_zoo.train.stages import STAGE_DIR, split


def _staged_config(**stage_model):
    config = tiny_config.get_config()
    config.train.update(num_steps=4, checkpoint_every=4)
    config.data.num_decode_examples = 4
    config.pre_stage = ml_collections.ConfigDict(dict(
        data=dict(batch_size=4, max_targets_length=8),
        optim=dict(learning_rate=1e-2),
        train=dict(num_steps=6, checkpoint_every=3)))
    if stage_model:
        config.pre_stage.model = stage_model
    return config


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("staged")
    train_and_evaluate(_staged_config(), workdir)
    return workdir


def test_staged_run_equals_the_pre_stage_then_init_from(staged, tmp_path):
    stage, run = split(_staged_config())
    assert (stage.data.batch_size, stage.train.num_steps, run.data.batch_size) == (4, 6, 8)
    train_and_evaluate(stage, tmp_path / "first")
    second = run.copy_and_resolve_references()
    second.pre_stage = {}
    second.init_from = str(tmp_path / "first")
    train_and_evaluate(second, tmp_path / "second")
    assert Checkpointer(staged / STAGE_DIR, read_only=True).all_steps() == [3, 6]
    assert Checkpointer(staged, read_only=True).all_steps() == [4]
    jax.tree.map(np.testing.assert_array_equal, load_run(staged / STAGE_DIR).params,
                 load_run(tmp_path / "first").params)
    jax.tree.map(np.testing.assert_array_equal, load_run(staged).params,
                 load_run(tmp_path / "second").params)
    saved = json.loads((staged / "config.json").read_text())["run"]
    assert saved["init_from"] == str(staged / STAGE_DIR) and not saved["pre_stage"]


def test_a_finished_pre_stage_is_not_trained_again(staged):
    metrics = staged / STAGE_DIR / "final_metrics.json"
    before = metrics.stat().st_mtime_ns, (staged / STAGE_DIR / "metrics.jsonl").read_text()
    train_and_evaluate(_staged_config(), staged)
    after = metrics.stat().st_mtime_ns, (staged / STAGE_DIR / "metrics.jsonl").read_text()
    assert after == before
    assert Checkpointer(staged, read_only=True).all_steps() == [4]


def test_a_longer_pre_stage_on_disk_is_refused_and_kept(staged):
    config = _staged_config()
    config.pre_stage.train.update(num_steps=5, checkpoint_every=5)
    with pytest.raises(ValueError, match=r"holds step 6, past pre_stage.train.num_steps=5"):
        train_and_evaluate(config, staged)
    assert Checkpointer(staged / STAGE_DIR, read_only=True).all_steps() == [3, 6]


@pytest.mark.parametrize("section, key, message", [
    ("data", "seq_lenght", r"pre_stage.data.seq_lenght is not a field of data"),
    ("data", "batch_size", r"data.batch_size must be >= 1, got 0"),
    ("nonsense", "x", r"pre_stage.nonsense is not a section"),
])
def test_a_bad_override_fails_before_anything_is_written(tmp_path, section, key, message):
    config = tiny_config.get_config()
    config.pre_stage = ml_collections.ConfigDict({section: {key: 0}})
    with pytest.raises(ValueError, match=message):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_pre_stage_of_another_model_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"pre_stage.model.d_ff=32 differs from model.d_ff=64"):
        train_and_evaluate(_staged_config(d_ff=32), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_zero_pre_stage_steps_switch_it_off():
    config = _staged_config()
    config.pre_stage.train.num_steps = 0
    stage, run = split(config)
    assert stage is None and run is config


def test_a_pre_stage_may_change_how_the_model_computes():
    stage, run = split(_staged_config(dropout_rate=0.0, attention_impl="blockwise"))
    assert (stage.model.dropout_rate, stage.model.attention_impl) == (0.0, "blockwise")
    assert (run.model.dropout_rate, run.model.attention_impl) == (0.05, "xla")

"""Checkpoints prove their contents and restores survive damage.

One reference run (8 steps, a checkpoint every 2) is copied per case and its
newest step damaged in one way; training resumes from the newest intact step with
the same per-step losses, the damaged step is moved aside (not deleted), the
intact steps stay byte-for-byte as they were, and decoding falls back for the
latest step but refuses an explicitly asked damaged one. Also: checksums catch
altered bytes, the NaN guard keeps non-finite parameters out of checkpoints, and
retention keeps the last k steps plus the best only when it is evaluated.
"""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.train import tiny_config
from tests.train.test_loop import _losses
from transformer_zoo.train.checkpoint import Checkpointer, DamagedCheckpointError
from transformer_zoo.train.loop import NonFiniteLossError, train_and_evaluate
from transformer_zoo.train.predict import load_run, restore_checkpoint

STEPS = (2, 4, 6, 8)


def _config(**train):
    config = tiny_config.get_config()
    config.data.num_decode_examples = 0
    config.train.update(num_steps=8, checkpoint_every=2, keep_checkpoints=10, log_every=1)
    config.train.update(**train)
    return config


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """A persistent compilation cache: each resumed run then compiles in no time."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    values = (str(tmp_path_factory.mktemp("jax_cache")), 0, 0)
    for name, value in zip(names, values, strict=True):
        jax.config.update(name, value)
    yield
    for name, value in before.items():
        jax.config.update(name, value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    train_and_evaluate(_config(), workdir)
    assert Checkpointer(workdir, read_only=True).all_steps() == list(STEPS)
    return workdir


def _digests(step_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(step_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(step_dir.rglob("*")) if p.is_file()}


def _biggest(item_dir: Path) -> Path:
    return max((p for p in item_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _half_copy(step: Path) -> None:
    """What an interrupted copy leaves: the step's metadata and params, nothing else."""
    for child in step.iterdir():
        if child.name not in ("_CHECKPOINT_METADATA", "params"):
            shutil.rmtree(child) if child.is_dir() else child.unlink()


# name -> (damage applied to checkpoints/8, whether decoding reads what it damages)
DAMAGE = {
    "truncated_params_data": (lambda s: _truncate(_biggest(s / "params")), True),
    "deleted_params_data": (lambda s: _biggest(s / "params").unlink(), True),
    "deleted_params_metadata": (lambda s: (s / "params" / "_METADATA").unlink(), True),
    "deleted_manifest": (lambda s: (s / "params" / "manifest.ocdbt").unlink(), True),
    "deleted_opt_state_data": (lambda s: _biggest(s / "opt_state").unlink(), False),
    "deleted_meta_item": (lambda s: shutil.rmtree(s / "meta"), False),
    "emptied_data_state": (lambda s: (s / "data" / "metadata").write_bytes(b""), False),
    "garbage_config": (lambda s: (s / "config" / "metadata").write_bytes(b"\x00{garbage"), True),
    "empty_step_dir": (lambda s: (shutil.rmtree(s), s.mkdir()), True),
    "half_copied_step": (_half_copy, True),
    "flipped_params_bytes": (lambda s: _flip(_biggest(s / "params")), True),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_step_is_moved_aside_and_training_resumes_bitwise(
        reference, tmp_path, kind, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    rows = (workdir / "metrics.jsonl").read_text().splitlines()
    (workdir / "metrics.jsonl").write_text(  # the resumed run must write steps 7, 8 anew
        "".join(r + "\n" for r in rows if json.loads(r)["step"] <= 6))
    ckpts = workdir / "checkpoints"
    damage, decoding_reads_it = DAMAGE[kind]
    damage(ckpts / "8")
    intact = {s: _digests(ckpts / str(s)) for s in (2, 4, 6)}

    if decoding_reads_it:
        with pytest.raises(ValueError, match=r"step 8 is damaged: \S+"):
            load_run(workdir, step=8)
    assert load_run(workdir).step == (6 if decoding_reads_it else 8)
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "4", "6", "8"]  # decoding renames none

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train"):
        train_and_evaluate(_config(), workdir)
    lines = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(lines) == 1 and "step 8 is damaged: " in lines[0] and "\n" not in lines[0], lines
    assert (ckpts / "8.damaged").is_dir()  # moved aside, not deleted
    assert Checkpointer(workdir, read_only=True).all_steps() == list(STEPS)
    assert {s: _digests(ckpts / str(s)) for s in (2, 4, 6)} == intact
    want, got = _losses(reference), _losses(workdir)
    assert [got[s] for s in (7, 8)] == [want[s] for s in (7, 8)]  # bitwise: same floats


def test_no_intact_step_is_a_value_error_naming_the_workdir(reference, tmp_path):
    workdir = tmp_path / "all_damaged"
    shutil.copytree(reference, workdir)
    for step in STEPS:
        (workdir / "checkpoints" / str(step) / "params" / "_METADATA").unlink()
    with pytest.raises(ValueError, match=f"{workdir}.* holds no intact checkpoint") as err:
        train_and_evaluate(_config(), workdir)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"{workdir} holds no intact checkpoint"):
        load_run(workdir)
    names = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    assert names == [str(s) for s in STEPS]  # nothing moved when nothing can be resumed


def test_checksums_catch_altered_array_bytes_and_name_the_parameter(reference, tmp_path):
    """Orbax reads altered-but-well-formed bytes without complaint; the checksums don't."""
    workdir = tmp_path / "swapped"
    shutil.copytree(reference, workdir)
    ckpts = workdir / "checkpoints"
    shutil.rmtree(ckpts / "8" / "checksums")  # step 8 now claims step 6's contents
    shutil.copytree(ckpts / "6" / "checksums", ckpts / "8" / "checksums")
    with pytest.raises(DamagedCheckpointError,
                       match=r"step 8 is damaged: params/: checksum of params array \S+ differs"):
        restore_checkpoint(workdir, step=8)
    assert restore_checkpoint(workdir).step == 6


def test_checkpoints_without_checksums_restore_with_a_warning(reference, tmp_path, caplog):
    workdir = tmp_path / "legacy"
    shutil.copytree(reference, workdir)
    for step in STEPS:
        shutil.rmtree(workdir / "checkpoints" / str(step) / "checksums")
    with caplog.at_level(logging.WARNING, logger="train"):
        restored = restore_checkpoint(workdir)
    assert restored.step == 8
    assert any("no checksums" in r.getMessage() for r in caplog.records)


def test_params_only_checkpoints_carry_checksums(reference, tmp_path):
    out = tmp_path / "averaged"
    params = restore_checkpoint(reference).params
    target = Checkpointer(out, async_save=False)
    target.save_params(8, params, {"model": {}, "family": "x"})
    target.wait()
    assert (out / "checkpoints" / "8" / "checksums").is_dir()
    Checkpointer(out, read_only=True).restore_params(8, params)  # verified, no error
    _flip(_biggest(out / "checkpoints" / "8" / "params"))
    with pytest.raises(DamagedCheckpointError, match="step 8 is damaged"):
        Checkpointer(out, read_only=True).restore_params(8, params)


def test_nan_guard_never_saves_parameters_that_overflow(tmp_path):
    config = _config(num_steps=4, checkpoint_every=1)
    config.optim.learning_rate = 1e30
    with pytest.raises(NonFiniteLossError, match=r"at step \d+"):
        train_and_evaluate(config, tmp_path)
    ckpt = Checkpointer(tmp_path, read_only=True)
    for step in ckpt.all_steps():
        params = jax.device_get(restore_checkpoint(tmp_path, step).params)
        biggest = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(params))
        assert np.isfinite(biggest) and biggest < 1e6, (step, biggest)


def test_retention_keeps_the_last_k_and_the_best_only_when_evaluated(tmp_path):
    train_and_evaluate(_config(num_steps=6, checkpoint_every=1, keep_checkpoints=2,
                               eval_every=0), tmp_path / "no_eval")
    assert Checkpointer(tmp_path / "no_eval", read_only=True).all_steps() == [5, 6]

    # best_mode max keeps the worst eval loss: an early step, not one of the last two.
    workdir = tmp_path / "eval"
    train_and_evaluate(_config(num_steps=6, checkpoint_every=1, keep_checkpoints=2,
                               eval_every=2, best_mode="max"), workdir)
    evals = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "eval":
            evals[row["step"]] = row["loss"]
    assert sorted(evals) == [2, 4, 6]
    best = max(evals, key=evals.get)
    assert Checkpointer(workdir, read_only=True).all_steps() == sorted({5, 6, best})

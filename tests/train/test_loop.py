"""The training loop end to end on a tiny model: loss falls, resume is bitwise,
NaN stops the run, incompatible workdirs are refused, averaging is a mean, and
decoding in a fresh process matches decoding in the training process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.train import tiny_config
from transformer_zoo.train.checkpoint import Checkpointer
from transformer_zoo.train.loop import NonFiniteLossError, train_and_evaluate
from transformer_zoo.train.predict import load_run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(tiny_config.__file__)


def _train_cmd(workdir, *overrides):
    return [sys.executable, "-m", "transformer_zoo.train", f"--config={CONFIG}",
            f"--workdir={workdir}",
            *overrides]


def _losses(workdir) -> dict[int, float]:
    """Per-step train loss; a re-run step keeps its last value."""
    out = {}
    for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "train":
            out[row["step"]] = row["loss"]
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    subprocess.run(_train_cmd(workdir), cwd=ROOT, check=True, capture_output=True)
    return workdir


def test_loss_falls(full_run):
    losses = _losses(full_run)
    assert sorted(losses) == list(range(1, 31))
    late = np.mean([losses[s] for s in range(26, 31)])
    assert late < 0.8 * np.mean([losses[s] for s in (1, 2, 3)])


def test_killed_and_resumed_run_is_bitwise_identical(full_run, tmp_path):
    workdir = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(workdir), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill once step 10 is committed and later steps ran
        done = (workdir / "checkpoints" / "10" / "commit_success.txt").exists() or (
            workdir / "checkpoints" / "10" / "_CHECKPOINT_METADATA").exists()
        if done and (workdir / "metrics.jsonl").exists() and max(_losses(workdir), default=0) >= 12:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(_losses(workdir))
    assert 12 <= killed_at < 30, f"the run was not killed mid-way (last step {killed_at})"
    subprocess.run(_train_cmd(workdir), cwd=ROOT, check=True, capture_output=True)
    assert _losses(workdir) == _losses(full_run)  # exact float equality, every step


def test_decode_in_fresh_process_equals_training_process(full_run, tmp_path):
    out = tmp_path / "hyp.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_zoo.train.decode", f"--workdir={full_run}",
         f"--input={full_run / 'heldout.src'}", f"--reference={full_run / 'heldout.ref'}",
         "--beam_size=2", f"--output={out}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (full_run / "heldout.hyp").read_text()
    assert "exact_match" in proc.stderr and "bleu" in proc.stderr


def test_decode_errors_exit_1_and_write_nothing(full_run, tmp_path):
    out = tmp_path / "never.txt"
    long_input = tmp_path / "long.txt"
    long_input.write_text("1" * 40 + "\n")
    cases = [
        ([f"--workdir={tmp_path / 'empty'}", f"--input={full_run / 'heldout.src'}"], "no checkp"),
        ([f"--workdir={full_run}", "--step=7", f"--input={full_run / 'heldout.src'}"], "step 7"),
        ([f"--workdir={full_run}", f"--input={long_input}"], "41 tokens"),
    ]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-m", "transformer_zoo.train.decode", *args,
                               f"--output={out}"],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        assert message in proc.stderr
        assert not out.exists()


def test_nan_loss_stops_with_the_step_and_keeps_good_checkpoints(tmp_path):
    config = tiny_config.get_config()
    config.optim.update(schedule="constant", learning_rate=1e30)
    config.train.checkpoint_every = 1
    with pytest.raises(NonFiniteLossError, match=r"at step \d+"):
        train_and_evaluate(config, tmp_path)
    steps = Checkpointer(tmp_path, read_only=True).all_steps()
    losses = _losses(tmp_path)
    assert steps and all(np.isfinite(losses[s]) for s in steps)


def test_incompatible_workdir_is_refused_and_untouched(full_run, tmp_path):
    import shutil

    workdir = tmp_path / "copy"
    shutil.copytree(full_run, workdir)
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    config = tiny_config.get_config()
    config.model.d_model = 48
    with pytest.raises(ValueError, match=r"parameter \S+ has shape \(\d+, 32\) in the checkpoint "
                                         r"but \(\d+, 48\) in the model"):
        train_and_evaluate(config, workdir)
    after = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    assert after == before


def test_average_is_the_mean_of_the_last_checkpoints(full_run, tmp_path):
    from transformer_zoo.train.average import average_run

    step = average_run(full_run, tmp_path / "avg", 3)
    assert step == 30
    ckpt = Checkpointer(full_run, read_only=True)
    loaded = load_run(full_run)
    trees = [ckpt.restore_params(s, loaded.params) for s in (10, 20, 30)]
    expected = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *trees)
    averaged = load_run(tmp_path / "avg")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 averaged.params, expected)
    assert averaged.translate(["12"], beam_size=1)  # decodable


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    workdir = tmp_path / "term"
    proc = subprocess.Popen(
        _train_cmd(workdir, "--config.train.num_steps=100000",
                   "--config.train.checkpoint_every=100000"),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        if (workdir / "metrics.jsonl").exists() and max(_losses(workdir), default=0) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    steps = Checkpointer(workdir, read_only=True).all_steps()
    assert len(steps) == 1 and 5 <= steps[0] < 100000  # saved only because of the signal
    assert "checkpoint saved" in stderr


def test_init_from_starts_from_another_runs_params(full_run, tmp_path):
    from transformer_zoo.train.loop import restore_or_start, setup

    config = tiny_config.get_config()
    config.init_from = str(full_run)
    run = setup(config, tmp_path / "finetune")
    state, data_state = restore_or_start(run)
    assert int(state.step) == 0 and data_state is None
    source = load_run(full_run).params
    jax.tree.map(np.testing.assert_array_equal, state.params, source)


def test_bf16_compute_trains_with_float32_params_and_eval_decodes(tmp_path):
    config = tiny_config.get_config()
    config.model.dtype = "bfloat16"
    config.train.num_steps = 5
    config.data.num_decode_examples = 4
    config.train.eval_every = 5  # periodic eval decodes a bounded subset too
    config.decode.eval_examples = 2
    train_and_evaluate(config, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [5] and "exact_match" in evals[0] and "loss" in evals[0]
    losses = _losses(tmp_path)
    assert len(losses) == 5 and all(np.isfinite(v) for v in losses.values())
    params = load_run(tmp_path).params
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}


def test_decoder_only_run_generates_in_process_and_from_the_cli(tmp_path):
    from transformer_zoo.configs import tinyshakespeare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question.\n" * 200)
    config = tinyshakespeare.get_config()
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1)
    config.data.update(path=str(corpus), seq_length=16, batch_size=4, max_eval_batches=2)
    config.train.update(num_steps=20, log_every=5, eval_every=0, checkpoint_every=20)
    config.optim.update(warmup_steps=5)
    config.decode.update(sample_length=40, sample_prompt="to")
    workdir = tmp_path / "lm"
    train_and_evaluate(config, workdir)
    sample = (workdir / "sample.txt").read_text()
    # <= 1 character per token (a barely trained model may sample PAD/BOS, shown as nothing).
    assert sample.startswith("to") and 20 < len(sample) <= len("to") + 40 + 1
    run = load_run(workdir)
    expected = run.generate(["to be"], max_new_tokens=12)
    assert len(expected) == 1 and len(expected[0]) > 0
    # Beyond the 64-position table: a sliding window, whose first chunk is the plain output.
    long = run.generate(["to be"], max_new_tokens=100)[0]
    assert len(long) == 100 and long.startswith(run.generate(["to be"], max_new_tokens=16)[0])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("to be\n")
    proc = subprocess.run([sys.executable, "-m", "transformer_zoo.train.decode",
                           f"--workdir={workdir}",
                           f"--input={prompts}", "--max_new_tokens=12"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == expected


def test_a_partially_written_checkpoint_is_never_restored(full_run, tmp_path):
    import shutil

    workdir = tmp_path / "partial"
    shutil.copytree(full_run, workdir)
    # What an interrupted orbax save leaves: a temporary directory, never renamed.
    partial = workdir / "checkpoints" / "40.orbax-checkpoint-tmp-1234"
    shutil.copytree(workdir / "checkpoints" / "30", partial)
    (partial / "params" / "garbage").write_text("half a file")
    ckpt = Checkpointer(workdir, read_only=True)
    assert ckpt.latest_step() == 30 and 40 not in ckpt.all_steps()
    assert load_run(workdir).step == 30


def _write_pairs(directory, name, examples):
    for side, key in (("en", "inputs"), ("de", "targets")):
        (directory / f"{name}.{side}").write_text("".join(e[key] + "\n" for e in examples))


def test_translation_recipe_averages_selects_on_val_and_reports_test(tmp_path):
    from transformer_zoo import data
    from transformer_zoo.configs import multi30k

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, n, seed in (("train", 400, 0), ("val", 12, 1), ("test", 10, 2)):
        ds = data.number_words("train", num_examples=n, seed=seed)
        _write_pairs(corpus, name, [ds[i] for i in range(n)])
    config = multi30k.get_config()
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                        num_decoder_layers=1, max_length=64)
    config.data.update(train_source=str(corpus / "train.en"), train_target=str(corpus / "train.de"),
                       eval_source=str(corpus / "val.en"), eval_target=str(corpus / "val.de"),
                       test_source=str(corpus / "test.en"), test_target=str(corpus / "test.de"),
                       vocab_size=64, batch_size=8, max_inputs_length=32, max_targets_length=32,
                       eval_batch_size=8, num_decode_examples=12)
    config.train.update(num_steps=6, checkpoint_every=2, eval_every=0, log_every=3,
                        average_last=3)
    config.decode.update(beam_size=2, max_extra=4, num_print=0)
    workdir = tmp_path / "run"
    result = train_and_evaluate(config, workdir)
    for key in ("bleu", "avg3_bleu", "test_bleu", "test_chrf", "selected_average"):
        assert key in result, key
    assert Checkpointer(workdir / "averaged", read_only=True).latest_step() == 6
    assert len((workdir / "test.hyp").read_text().splitlines()) == 10
    assert len((workdir / "heldout_avg3.hyp").read_text().splitlines()) == 12
    saved = json.loads((workdir / "final_metrics.json").read_text())
    assert saved["test_bleu"] == result["test_bleu"]
    # Re-running the finished run reuses the averaged checkpoint instead of failing.
    assert train_and_evaluate(config, workdir)["test_bleu"] == result["test_bleu"]

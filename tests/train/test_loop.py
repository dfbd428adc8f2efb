"""The training loop end to end on a tiny model: loss falls, resume is bitwise,
NaN stops the run, incompatible workdirs are refused, averaging is a mean, and
decoding in a fresh process matches decoding in the training process."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.train import tiny_config, tiny_translation
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
    """No search flag: the CLI decodes with the run's own beam (2 in the tiny config)."""
    out = tmp_path / "hyp.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_zoo.train.decode", f"--workdir={full_run}",
         f"--input={full_run / 'heldout.src'}", f"--reference={full_run / 'heldout.ref'}",
         f"--output={out}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (full_run / "heldout.hyp").read_text()
    assert "exact_match" in proc.stderr and "bleu" in proc.stderr


def test_decode_errors_exit_1_and_write_nothing(full_run, tmp_path):
    out = tmp_path / "never.txt"
    long_input = tmp_path / "long.txt"
    long_input.write_text("1" * 40 + "\n")
    src = f"--input={full_run / 'heldout.src'}"
    cases = [
        ([f"--workdir={tmp_path / 'empty'}", src], "no checkp"),
        ([f"--workdir={full_run}", "--step=7", src], "step 7"),
        ([f"--workdir={full_run}", f"--input={long_input}"], "41 tokens"),
        # absl parse errors (no usage text) and options the search cannot honour.
        ([f"--workdir={full_run}", src, "--beam_size=two"], "--beam_size=two"),
        ([f"--workdir={full_run}", src, "--search=beam", "--temperature=0.8"],
         "temperature=0.8 does not apply to search=beam"),
    ]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-m", "transformer_zoo.train.decode", *args,
                               f"--output={out}"],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
        assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
        assert not out.exists() and proc.stdout == ""


def _decode_cli(capsys, *args) -> tuple[int, str, str]:
    """`python -m transformer_zoo.train.decode ARGS` in this process: (code, stdout, stderr)."""
    from transformer_zoo.train import decode

    capsys.readouterr()
    code = decode.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _cli_run(workdir):
    """The run as the CLI restores it (the kernels it picks on this machine)."""
    from transformer_zoo.train.parallel import kernels_for

    return load_run(workdir, kernels=kernels_for(jax.devices()))


def test_load_run_translates_with_beams_n_best_and_samples(full_run):
    """One interface for every search: n-best lists sorted by score whose first
    entry is the plain beam output; seeded, reproducible samples that differ
    across seeds and do not depend on the batching; top_k=1 sampling is greedy."""
    run = load_run(full_run)
    src = (full_run / "heldout.src").read_text().splitlines()
    plain = run.translate(src, beam_size=4)
    n_best = run.translate(src, beam_size=4, n_best=3)
    assert [hyps[0].text for hyps in n_best] == plain
    for hyps in n_best:
        scores = [h.score for h in hyps]
        assert len(hyps) == 3 and scores == sorted(scores, reverse=True), hyps
    assert run.translate(src, search="beam", beam_size=4) == plain
    # Without options, or with some, beam search takes the rest from the run's config.
    assert run.decode_preset["beam_size"] == 2 and run.decode_preset["alpha"] == 0.6
    own = run.translate(src, beam_size=2, alpha=0.6)
    assert run.translate(src) == own and run.translate(src, search="beam") == own
    assert run.translate(src, alpha=0.6) == own
    greedy = run.translate(src, search="greedy")
    assert greedy == run.translate(src, beam_size=1)  # today's spelling of greedy
    assert run.translate(src, search="sample", top_k=1, seed=5) == greedy
    sampled = run.translate(src, temperature=0.7, seed=1)  # was a TypeError
    assert sampled == run.translate(src, temperature=0.7, seed=1)
    assert sampled != run.translate(src, temperature=0.7, seed=2) and sampled != greedy
    # Sample j of input i depends on the seed, i and j only: the first of three
    # samples is the single sample, whatever the batch size.
    three = run.translate(src, temperature=0.7, seed=1, num_samples=3, batch_size=5)
    assert [s[0].text for s in three] == sampled
    assert all(len(s) == 3 and s[0].score is None for s in three)
    assert any(len({h.text for h in s}) > 1 for s in three)
    for options, message in [({"temperature": 0.7, "search": "beam"}, "search=beam"),
                             ({"beam_size": 2, "n_best": 3}, "n_best must be in"),
                             ({"beam_size": 4, "top_p": 0.9}, "choose one"),
                             ({"max_new_tokens": 5}, "encoder_decoder runs")]:
        with pytest.raises(ValueError, match=message):
            run.translate(src[:1], **options)
    with pytest.raises(ValueError, match="needs a decoder_only run"):
        run.generate(src[:1])


def _rows(text: str) -> list[list[str]]:
    return [line.split("\t") for line in text.splitlines()]


def test_decode_cli_writes_n_best_lists_and_samples(full_run, tmp_path, capsys):
    run = _cli_run(full_run)
    src_file = full_run / "heldout.src"
    src = src_file.read_text().splitlines()
    base = [f"--workdir={full_run}", f"--input={src_file}"]
    code, plain, err = _decode_cli(capsys, *base, "--beam_size=4")
    assert code == 0, err
    out = tmp_path / "n_best.tsv"
    code, stdout, err = _decode_cli(capsys, *base, "--beam_size=4", "--n_best=3", f"--output={out}")
    assert code == 0 and stdout == "", err
    rows = _rows(out.read_text())
    expected = run.translate(src, beam_size=4, n_best=3)
    assert [r[0] for r in rows] == [str(i) for i in range(len(src)) for _ in range(3)]
    assert [r[1] for r in rows] == ["1", "2", "3"] * len(src)
    assert [r[3] for r in rows] == [h.text for hyps in expected for h in hyps]
    np.testing.assert_allclose([float(r[2]) for r in rows],
                               [h.score for hyps in expected for h in hyps], atol=1e-3)
    assert [r[3] for r in rows[::3]] == plain.splitlines()
    # The command: sampling options on an encoder-decoder run now sample.
    code, sampled, err = _decode_cli(capsys, *base, "--temperature", "0.8", "--top_k", "5",
                                     "--seed=1")
    assert code == 0, err
    assert sampled.splitlines() == run.translate(src, temperature=0.8, top_k=5, seed=1)
    assert _decode_cli(capsys, *base, "--temperature=0.8", "--top_k=5", "--seed=1")[1] == sampled
    assert _decode_cli(capsys, *base, "--temperature=0.8", "--top_k=5", "--seed=2")[1] != sampled
    code, samples, err = _decode_cli(capsys, *base, "--search=sample", "--temperature=0.8",
                                     "--top_k=5", "--seed=1", "--num_samples=2",
                                     "--batch_size=3")
    assert code == 0, err
    rows = _rows(samples)
    assert [r[:2] for r in rows] == [[str(i), j] for i in range(len(src)) for j in ("1", "2")]
    assert [r[2] for r in rows[::2]] == sampled.splitlines()


def test_decode_cli_refuses_what_it_cannot_honour(full_run, tmp_path, capsys):
    """Conflicting or unusable options exit 1 with one line and write nothing."""
    out = tmp_path / "never.txt"
    base = [f"--workdir={full_run}", f"--input={full_run / 'heldout.src'}", f"--output={out}"]
    cases = [
        (["--temperature=0.8", "--search=beam"], "temperature=0.8 does not apply to search=beam"),
        (["--beam_size=4", "--n_best=5"], "n_best must be in [1, beam_size=4], got 5"),
        (["--n_best=2", "--search=sample"], "n_best=2 does not apply to search=sample"),
        (["--n_best=2", f"--reference={full_run / 'heldout.ref'}"], "--reference scores one"),
        (["--beam_size=2", "--temperature=0.5"], "asks for search=beam"),
        (["--seed=3"], "seed=3 does not apply to search=beam"),
        (["--search=greedy", "--alpha=0.6"], "alpha=0.6 does not apply to search=greedy"),
        (["--search=sample", "--temperature=0"], "temperature must be > 0"),
        (["--num_samples=0"], "num_samples must be >= 1"),
        (["--max_new_tokens=10"], "max_new_tokens=10 does not apply to encoder_decoder runs"),
        (["--search=nucleus"], "value should be one of <greedy|beam|sample>"),
        (["--bogus=1"], "Unknown command line flag 'bogus'"),
        (["stray"], "unexpected positional arguments"),
    ]
    for args, message in cases:
        code, stdout, err = _decode_cli(capsys, *base, *args)
        assert code == 1, (args, err)
        assert err.startswith("error: ") and message in err, (args, err)
        assert err.count("\n") == 1 and stdout == "" and not out.exists(), (args, err)
    code, _, err = _decode_cli(capsys, f"--input={full_run / 'heldout.src'}")
    assert code == 1 and err == "error: flag --workdir=None: Flag --workdir must have a value " \
                                "other than None.\n"


def test_average_cli_takes_absl_flags(full_run, tmp_path, capsys):
    from transformer_zoo.train import average

    output = tmp_path / "avg"
    cases = [(["--last=0"], "--last=0"), (["--last=three"], "--last=three"),
             (["--last=9"], "asked to average 9"), ([], "--last must have a value")]
    for args, message in cases:
        capsys.readouterr()
        assert average.main([f"--workdir={full_run}", f"--output={output}", *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert not output.exists()
    assert average.main([f"--workdir={full_run}", f"--output={output}", "--last", "2"]) == 0
    assert "averaged the last 2 checkpoints" in capsys.readouterr().out
    assert load_run(output).step == 30


def test_nan_loss_stops_with_the_step_and_keeps_good_checkpoints(tmp_path):
    config = tiny_config.get_config()
    config.optim.update(schedule="constant", learning_rate=1e30)
    config.train.checkpoint_every = 1
    with pytest.raises(NonFiniteLossError, match=r"at step \d+"):
        train_and_evaluate(config, tmp_path)
    steps = Checkpointer(tmp_path, read_only=True).all_steps()
    losses = _losses(tmp_path)
    assert all(np.isfinite(losses[s]) for s in steps)
    # Only finite parameters are saved: Adam's first step at lr 1e30 already makes them
    # ~1e30, so this run keeps none (before, it kept that step as "good").
    for s in steps:
        leaves = jax.tree.leaves(load_run(tmp_path, step=s).params)
        assert all(np.abs(np.asarray(x)).max() < 1e10 for x in leaves)


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


def test_decoder_only_run_generates_in_process_and_from_the_cli(tmp_path, capsys):
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
    _decoder_only_searches(run, expected, capsys, tmp_path)


def _decoder_only_searches(run, expected, capsys, tmp_path):
    """Beam search, n-best and samples of a decoder-only run, in process and from the CLI."""
    beams = run.generate(["to be"], max_new_tokens=12, beam_size=3, n_best=3)[0]
    assert len(beams) == 3 and [h.score for h in beams] == sorted((h.score for h in beams),
                                                                  reverse=True)
    assert run.generate(["to be"], max_new_tokens=12, search="beam", beam_size=3) == [beams[0].text]
    assert run.generate(["to be"], max_new_tokens=12, search="sample", top_k=1) == expected
    samples = run.generate(["to be", "or"], max_new_tokens=12, temperature=1.5, seed=1,
                           num_samples=3)
    assert [len(s) for s in samples] == [3, 3] and len({h.text for h in samples[0]}) > 1
    assert run.generate(["or"], max_new_tokens=12, temperature=1.5, seed=1, num_samples=3) != [
        [h.text for h in samples[1]]]  # sample j of input i depends on i
    with pytest.raises(ValueError, match="beam search needs prompt"):
        run.generate(["to be"], max_new_tokens=100, beam_size=2)
    with pytest.raises(ValueError, match="max_extra=3 does not apply to decoder_only runs"):
        run.decode(["to be"], max_extra=3)
    prompts, out = tmp_path / "prompts.txt", tmp_path / "beams.tsv"
    prompts.write_text("to be\n")
    base = [f"--workdir={tmp_path / 'lm'}", f"--input={prompts}", "--max_new_tokens=12"]
    code, _, err = _decode_cli(capsys, *base, "--beam_size=3", "--n_best=3", f"--output={out}")
    assert code == 0, err
    rows = _rows(out.read_text())
    assert [r[:2] for r in rows] == [["0", "1"], ["0", "2"], ["0", "3"]]
    np.testing.assert_allclose([float(r[2]) for r in rows], [h.score for h in beams], atol=1e-3)
    code, _, err = _decode_cli(capsys, *base, "--max_extra=3", f"--output={out}.x")
    assert code == 1 and "max_extra=3 does not apply" in err and not Path(f"{out}.x").exists()


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


def test_translation_recipe_averages_selects_on_val_and_reports_test(tmp_path):
    config = tiny_translation.config(tmp_path)
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
    # The averaged directory decodes on its own (config and tokenizer), in a fresh
    # process, to the hypotheses the training process wrote for it.
    out = tmp_path / "avg.hyp"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_zoo.train.decode", f"--workdir={workdir / 'averaged'}",
         f"--input={workdir / 'heldout_avg3.src'}", "--beam_size=2",
         f"--alpha={config.decode.alpha}", "--max_extra=4",
         f"--batch_size={config.decode.batch_size}", f"--output={out}"],
        cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (workdir / "heldout_avg3.hyp").read_text()
    # Re-running the finished run reuses the averaged checkpoint instead of failing.
    assert train_and_evaluate(config, workdir)["test_bleu"] == result["test_bleu"]


def test_run_header_shows_devices_mesh_model_and_command_line_overrides(tmp_path):
    workdir = tmp_path / "header"
    proc = subprocess.run(_train_cmd(workdir, "--config.train.num_steps=2",
                                     "--config.optim.learning_rate=0.004"),
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    devices = re.search(r"^devices: (\d+) x (\w+) \(", out, re.M)
    assert devices, out
    assert (int(devices[1]), devices[2]) == (jax.device_count(), jax.devices()[0].platform)
    assert re.search(rf"^mesh: shape \({jax.device_count()}, 1, 1\) over axes "
                     r"\('data', 'fsdp', 'tensor'\), step jit$", out, re.M), out
    total = re.search(r"^total\s+([\d,]+)\s", out, re.M)
    params = load_run(workdir).params
    assert total and int(total[1].replace(",", "")) == sum(x.size for x in jax.tree.leaves(params))
    overrides = next(line for line in out.splitlines() if line.startswith("config overrides"))
    assert "train.num_steps=2" in overrides and "optim.learning_rate=0.004" in overrides
    assert "seed" not in overrides  # only what the command line gave
    assert out.count("devices: ") == 1  # printed once


def _char_lm_config(corpus, **model):
    from transformer_zoo.configs import tinyshakespeare

    config = tinyshakespeare.get_config()
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1, **model)
    config.data.update(path=str(corpus), seq_length=16, batch_size=4)
    config.train.update(num_steps=10, log_every=5, eval_every=10, checkpoint_every=10)
    config.optim.update(warmup_steps=2)
    config.decode.update(sample_length=0)
    return config


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_long_context_loss_scores_the_held_out_text_in_longer_rows(tmp_path, position):
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    corpus.write_text("".join(rng.choice(list("abcdefgh \n"), size=4000)))
    config = _char_lm_config(corpus, position_encoding=position, attention_impl="blockwise")
    # At the training length it is the ordinary held-out loss over all the text ...
    config.data.long_eval_length = 16
    same = train_and_evaluate(config, tmp_path / "same")
    assert same["long_context_length"] == 16
    np.testing.assert_allclose(same["long_context_loss"], same["loss"], rtol=1e-6)
    # ... and at 4x it is the same model scored in 64-character rows: equal to
    # the loss computed here from the restored parameters.
    config.data.long_eval_length = 64
    longer = train_and_evaluate(config, tmp_path / "longer")
    run = load_run(tmp_path / "longer")
    held_out = np.asarray(run.tokenizer.encode(corpus.read_text()), np.int32)[3600:]
    rows = held_out[: len(held_out) // 64 * 64].reshape(-1, 64)
    logits = run.model.apply({"params": run.params}, rows)  # logits[:, t] predicts rows[:, t]
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64))
    nll = -np.take_along_axis(logp, rows[..., None], axis=-1).mean()
    np.testing.assert_allclose(longer["long_context_loss"], nll, rtol=1e-4)
    assert longer["long_context_loss"] != pytest.approx(longer["loss"], rel=1e-3)

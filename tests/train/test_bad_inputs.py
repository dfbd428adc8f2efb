"""Bad inputs to every command: one `error: ...` line, exit code 1 (130 for Ctrl-C).

The training command's cases run as subprocesses (it may restart itself for huge
pages, so it is not imported here), all started at once by one fixture; the
decode and average commands' `main(argv)` and the Python API run in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformer_zoo import data
from transformer_zoo.train import average, decode, predict

ROOT = Path(__file__).resolve().parents[2]
TINY = "tests/train/tiny_config.py"
MULTI30K = "configs/multi30k.py"

# name -> (config file, overrides, text the one error line must contain).
# {good}, {blank}, {bad_utf8}, {a_file}, {missing} are files in the fixture's folder.
_FILES = ("--config.data.eval_source={good}", "--config.data.eval_target={good}",
          "--config.data.test_source=")
TRAIN_CASES = {
    "config_missing": ("nope/config.py", (), "config file nope/config.py does not exist"),
    "unknown_key": (TINY, ("--config.model.d_modl=8",), 'Did you mean "d_model"'),
    "d_model_0": (TINY, ("--config.model.d_model=0",),
                  "ModelConfig.d_model must be positive, got 0"),
    "vocab_size_0": (TINY, ("--config.model.vocab_size=0",),
                     "ModelConfig.vocab_size must be positive, got 0"),
    "num_steps_negative": (TINY, ("--config.train.num_steps=-5",),
                           "train.num_steps must be >= 1, got -5"),
    "log_every_0": (TINY, ("--config.train.log_every=0",), "train.log_every must be >= 1, got 0"),
    "checkpoint_every_0": (TINY, ("--config.train.checkpoint_every=0",),
                           "train.checkpoint_every must be >= 1, got 0"),
    "keep_checkpoints_0": (TINY, ("--config.train.keep_checkpoints=0",),
                           "train.keep_checkpoints must be >= 1, got 0"),
    "eval_every_negative": (TINY, ("--config.train.eval_every=-1",),
                            "train.eval_every must be >= 0, got -1"),
    "average_last_negative": (TINY, ("--config.train.average_last=-2",),
                              "train.average_last must be >= 0, got -2"),
    "label_smoothing_1": (TINY, ("--config.train.label_smoothing=1.0",),
                          "train.label_smoothing must be >= 0.0 and < 1.0, got 1.0"),
    "learning_rate_0": (TINY, ("--config.optim.learning_rate=0",),
                        "optim.learning_rate must be > 0.0, got 0"),
    "batch_size_0": (TINY, ("--config.data.batch_size=0",), "data.batch_size must be >= 1, got 0"),
    "num_decode_negative": (TINY, ("--config.data.num_decode_examples=-1",),
                            "data.num_decode_examples must be >= 0, got -1"),
    "beam_size_0": (TINY, ("--config.decode.beam_size=0",), "decode.beam_size must be >= 1, got 0"),
    # Refused before the tokenizer is trained (the optimizer is built after it).
    "cosine_shorter_than_warmup": (
        MULTI30K, (*_FILES, "--config.data.train_source={good}",
                   "--config.data.train_target={good}", "--config.train.num_steps=100"),
        "optim.schedule='warmup_cosine' decays over train.num_steps=100, which must exceed "
        "optim.warmup_steps=2000"),
    "workdir_is_a_file": (TINY, ("--workdir={a_file}",), "is not a directory"),
    "workdir_not_writable": (TINY, ("--workdir=/sys/zoo_workdir",),
                             "--workdir /sys/zoo_workdir is not writable"),
    "data_file_missing": (MULTI30K, (*_FILES, "--config.data.train_source={missing}",
                                     "--config.data.train_target={good}"),
                          "data.train_source: {missing} does not exist"),
    "train_file_blank": (MULTI30K, (*_FILES, "--config.data.train_source={good}",
                                    "--config.data.train_target={blank}"),
                         "data.train_target: {blank} is empty or holds only blank lines"),
    "train_file_not_utf8": (MULTI30K, (*_FILES, "--config.data.train_source={bad_utf8}",
                                       "--config.data.train_target={good}"),
                            "data.train_source: {bad_utf8} is not valid UTF-8 (byte 3"),
    "long_eval_beyond_learned_positions": (
        "configs/tinyshakespeare.py", ("--config.data.path={good}", "--config.data.seq_length=4",
                                       "--config.data.long_eval_length=128"),
        "data.long_eval_length=128 is longer than the learned position table "
        "(model.max_length=64)"),
    "long_eval_beyond_held_out_text": (
        "configs/shakespeare_long.py", ("--config.data.path={good}", "--config.data.seq_length=2",
                                        "--config.data.long_eval_length=8",
                                        "--config.pre_stage.train.num_steps=0"),
        "data.long_eval_length=8 is longer than the held-out text (3 tokens)"),
}
# Trained once, for the decode cases (seconds each).
RUNS = {"ed": (), "do": ("--config.family=decoder_only",)}


def _command(config: str, args, workdir) -> list[str]:
    wd = [] if any(a.startswith("--workdir") for a in args) else [f"--workdir={workdir}"]
    return [sys.executable, "-m", "transformer_zoo.train", f"--config={config}", *wd, *args]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("inputs")
    (d / "good.txt").write_text("hello world\nhow are you\n")
    (d / "blank.txt").write_text("\n   \n\t\n")
    (d / "bad.txt").write_bytes(b"ok\n\xff\xfe not utf-8\n")
    (d / "a_file").write_text("not a directory\n")
    return {"good": str(d / "good.txt"), "blank": str(d / "blank.txt"),
            "bad_utf8": str(d / "bad.txt"), "a_file": str(d / "a_file"),
            "missing": str(d / "missing.txt"), "dir": str(d)}


@pytest.fixture(scope="module")
def train_results(files):
    """Every bad-input case and the two short training runs, started together."""
    procs = {}
    for name, (config, args, _) in TRAIN_CASES.items():
        cmd = _command(config, [a.format(**files) for a in args], Path(files["dir"]) / name)
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, extra in RUNS.items():
        args = ["--config.train.num_steps=2", "--config.train.checkpoint_every=2",
                "--config.data.num_decode_examples=0", *extra]
        procs[name] = subprocess.Popen(_command(TINY, args, Path(files["dir"]) / name),
                                       cwd=ROOT, env=_env(), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = (p.returncode, stdout, stderr)
    return out


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.parametrize("name", sorted(TRAIN_CASES))
def test_train_bad_input(name, train_results, files):
    code, stdout, stderr = train_results[name]
    line = _one_error_line(stderr)
    assert code == 1, (code, stderr)
    assert TRAIN_CASES[name][2].format(**files) in line
    assert stdout == ""  # nothing started: no run header
    if name != "long_eval_beyond_held_out_text":  # counting the text needs the tokenizer
        assert not (Path(files["dir"]) / name).exists()  # nothing written


@contextlib.contextmanager
def _sigint_not_ignored():
    """Lets the command started inside receive SIGINT whatever this process inherited.

    A shell without job control starts a background job (`pytest ... &`, a CI
    runner's) with SIGINT ignored, and an ignored signal stays ignored across fork
    and exec: Python then installs no KeyboardInterrupt handler and the command
    would never see the Ctrl-C this test sends. A handled signal is reset to its
    default at exec instead, so the command starts as from an interactive shell.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_library(p: subprocess.Popen, name: str, timeout: float = 60.0) -> None:
    """Waits until process `p` has loaded a shared library whose path holds `name`.

    A fixed sleep is not enough: on a loaded machine the interpreter may not have
    reached the command's code yet. Without /proc (not Linux) it sleeps 1 s instead.
    """
    maps = Path(f"/proc/{p.pid}/maps")
    if not Path("/proc/self/maps").exists():
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # between the restart's exec and its mapping
            if name in maps.read_text():
                return
        time.sleep(0.005)
    pytest.fail(f"the command (exit code {p.poll()}) did not load {name} in {timeout} s")


@pytest.mark.parametrize("phase,message", [
    ("start", "interrupted before the run started; nothing was written"),
    ("set-up", "interrupted during set-up, compilation or the final decode"),
])
def test_train_sigint_is_one_line(phase, message, tmp_path):
    workdir = tmp_path / "run"
    with _sigint_not_ignored():
        p = subprocess.Popen(_command(TINY, (), workdir), cwd=ROOT, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if phase == "start":  # the config file is importing numpy, then jax: flags are parsed
        _wait_for_library(p, "_multiarray_umath")
    else:
        deadline = time.monotonic() + 60
        while not workdir.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # set-up has begun once it creates the workdir
        time.sleep(0.2)  # inside building the input and the model (about 2 s)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == [stderr.strip().splitlines()[-1]], stderr
    assert message in errors[0]


# Config files that fail as libraries do when a Ctrl-C lands inside them, or fail alike
# with no Ctrl-C: numpy's C extensions cut short while the config file imports them
# (`import_array` prints the KeyboardInterrupt through sys.excepthook and raises a fresh
# ImportError), and jax during set-up (a pytree comparison re-raises it as ValueError).
_CUT_SHORT = """
import os, signal, sys, time
from transformer_zoo.configs import default
from transformer_zoo.train import loop


def cut_short(error):
    try:
        if {interrupt}:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
    raise error


def set_up(config, workdir):
    cut_short(ValueError("Exception raised while checking equality of metadata fields"))


get_config = default.get_config
if "{phase}" == "import":
    cut_short(ImportError("numpy._core.multiarray failed to import"))
loop.train_and_evaluate = set_up
"""


@pytest.mark.parametrize("phase", ["import", "set-up"])
@pytest.mark.parametrize("interrupt", [True, False])
def test_train_sigint_inside_a_library_is_one_line(phase, interrupt, tmp_path):
    config = tmp_path / "config.py"
    config.write_text(_CUT_SHORT.format(interrupt=interrupt, phase=phase))
    workdir = tmp_path / "run"
    with _sigint_not_ignored():
        result = subprocess.run(_command(str(config), (), workdir), cwd=ROOT, env=_env(),
                                capture_output=True, text=True, timeout=120)
    stderr = result.stderr.strip()
    if interrupt:
        assert result.returncode == 130, stderr
        assert stderr == ("error: interrupted before the run started; nothing was written"
                          if phase == "import" else "error: interrupted during set-up, "
                          f"compilation or the final decode; the latest checkpoint in "
                          f"{workdir} is kept")
    elif phase == "import":  # no Ctrl-C: a bug in the config file keeps its traceback
        assert result.returncode == 1, stderr
        assert "Traceback" in stderr and "KeyboardInterrupt" not in stderr
        assert stderr.endswith("numpy._core.multiarray failed to import")
    else:  # no Ctrl-C: a ValueError in set-up is the run's one error line
        assert result.returncode == 1, stderr
        assert stderr == "error: Exception raised while checking equality of metadata fields"
    assert not workdir.exists()


def _run_ok(train_results, name: str) -> None:
    code, _, stderr = train_results[name]
    assert code == 0, stderr


@pytest.mark.parametrize("run,flags,message", [
    ("ed", ["--max_extra=-5"], "max_extra must be a positive int, got -5"),
    ("ed", ["--temperature=-1"], "temperature must be > 0"),
    ("ed", ["--max_new_tokens=5"], "max_new_tokens=5 does not apply to encoder_decoder"),
    ("do", ["--max_new_tokens=-1"], "max_new_tokens must be a positive int, got -1"),
    ("do", ["--beam_size=0"], "beam_size must be >= 1, got 0"),
    ("ed", ["--batch_size=0"], "flag --batch_size=0"),
])
def test_decode_bad_flags(run, flags, message, train_results, files, capsys):
    _run_ok(train_results, run)
    source = Path(files["dir"]) / "in.txt"
    source.write_text("12\n")
    assert decode.main([f"--workdir={Path(files['dir']) / run}", f"--input={source}",
                        *flags]) == 1
    captured = capsys.readouterr()
    assert message in _one_error_line(captured.err)
    assert captured.out == ""


def test_decode_beam_search_is_honoured_for_decoder_only(train_results, files, capsys):
    _run_ok(train_results, "do")
    source = Path(files["dir"]) / "prompt.txt"
    source.write_text("12\n")
    assert decode.main([f"--workdir={Path(files['dir']) / 'do'}", f"--input={source}",
                        "--beam_size=4", "--n_best=2", "--max_new_tokens=3"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[:2] for r in rows] == [["0", "1"], ["0", "2"]]  # two ranked beams
    assert float(rows[0][2]) >= float(rows[1][2])


@pytest.mark.parametrize("last", ["0", "-1"])
def test_average_last_below_one(last, tmp_path, capsys):
    assert average.main([f"--workdir={tmp_path}", f"--last={last}",
                         f"--output={tmp_path / 'avg'}"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert f"--last={last}" in line and "is not a positive integer" in line
    assert not (tmp_path / "avg").exists()


def test_truncated_tokenizer_json(tmp_path, train_results, files, capsys):
    directory = tmp_path / "tokenizer"
    data.number_tokenizer().save(directory)
    config = directory / "tokenizer.json"
    config.write_text(config.read_text()[:10])
    with pytest.raises(ValueError, match="truncated or not a saved tokenizer") as err:
        data.load_tokenizer(directory)
    assert str(config) in str(err.value) and f"delete {directory}" in str(err.value)
    config.write_text(json.dumps(["not", "an", "object"]))
    with pytest.raises(ValueError, match="not an object"):
        data.load_tokenizer(directory)
    # Through the decode command: one line naming the file.
    _run_ok(train_results, "ed")
    run = tmp_path / "run"
    shutil.copytree(Path(files["dir"]) / "ed", run)
    (run / "tokenizer" / "tokenizer.json").write_text('{"type": "word_ch')
    source = tmp_path / "in.txt"
    source.write_text("12\n")
    assert decode.main([f"--workdir={run}", f"--input={source}"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "tokenizer.json is truncated" in line and "restore it from a backup" in line


@pytest.mark.parametrize("family,method", [("encoder_decoder", "translate"),
                                           ("decoder_only", "generate"),
                                           ("encoder_only", "embed"),
                                           ("encoder_decoder", "decode")])
def test_a_bare_string_is_refused(family, method):
    run = predict.LoadedRun(family=family, model=None, params=None,
                            tokenizer=data.number_tokenizer(), step=0, run_config={})
    with pytest.raises(TypeError, match=rf"{method} takes a sequence of texts, got one str "
                                        r"'1204'; pass \[text\]"):
        getattr(run, method)("1204")


def test_out_of_range_token_ids_are_refused_on_the_host():
    class Stub:
        vocab_size, eos_id, pad_id = 10, 2, 0

        def encode(self, text):
            return [int(t) for t in text.split()]

    assert predict.encode_batch(Stub(), ["3 4", "9"], None).shape == (2, 8)
    with pytest.raises(ValueError, match=r"input 1 has token id 12 outside the vocabulary "
                                         r"\[0, 10\)"):
        predict.encode_batch(Stub(), ["3 4", "5 12"], None)
    with pytest.raises(ValueError, match="token id -1"):
        predict.encode_batch(Stub(), ["-1"], None)
    with pytest.raises(TypeError, match="texts takes a sequence of texts"):
        predict.encode_batch(Stub(), "3 4", None)

"""Faults at any moment of a training run: SIGKILL, signals, a full or failing disk,
a read-only workdir, and decoders reading while the trainer deletes checkpoints.

Every faulted run is `python -m transformer_zoo.train` with the fault injected at an
exact moment by tests/train/fault_worker.py (or a signal sent from here when a line
appears in its log). Each asserts what the fault leaves (exit code, one error line,
no traceback, the checkpoints committed before it byte for byte) and, where the run
is then resumed, that the per-step losses, the final parameters and the final
metrics are bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.train.test_loop import _losses
from transformer_zoo.train.checkpoint import Checkpointer
from transformer_zoo.train.predict import restore_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "train" / "fault_worker.py"
FLAGS = ("--config", "tests/train/tiny_config.py", "--config.train.num_steps=30",
         "--config.train.checkpoint_every=10", "--config.train.eval_every=10",
         "--config.train.keep_checkpoints=5", "--config.data.num_decode_examples=4")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A persistent compilation cache shared by every run of this module."""
    return tmp_path_factory.mktemp("jax_cache")


def _env(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
            "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _start(fault: str, workdir: Path, cache_dir: Path, *extra: str) -> tuple[subprocess.Popen,
                                                                               Path]:
    logs = cache_dir.parent / "logs"  # not beside the workdir: that may be read-only
    logs.mkdir(exist_ok=True)
    log = logs / f"{workdir.name}.{fault.replace(':', '_')}.{time.time_ns()}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(WORKER), fault, *FLAGS,
                                 f"--workdir={workdir}", *extra], cwd=ROOT,
                                env=_env(cache_dir), stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _run(fault: str, workdir: Path, cache_dir: Path, *extra: str,
         timeout: float = 240) -> tuple[int, str]:
    proc, log = _start(fault, workdir, cache_dir, *extra)
    try:
        proc.wait(timeout=timeout)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, log.read_text()


def _error_line(output: str) -> str:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == output.strip().splitlines()[-1], output
    return errors[0]


def _digests(step_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(step_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(step_dir.rglob("*")) if p.is_file()}


def _outcome(workdir: Path) -> dict:
    """What an uninterrupted run must equal: per-step losses, the final step's
    parameter checksums (the crc32 of every array) and the final metrics."""
    sums = json.loads((workdir / "checkpoints" / "30" / "checksums" / "metadata").read_text())
    final = json.loads((workdir / "final_metrics.json").read_text())
    return {"losses": _losses(workdir), "params": sums["params"], "final": final}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> dict:
    workdir = tmp_path_factory.mktemp("faults") / "reference"
    code, output = _run("none", workdir, cache_dir)
    assert code == 0, output
    out = _outcome(workdir)
    assert sorted(out["losses"]) == list(range(1, 31))
    return out


def _resume(workdir: Path, cache_dir: Path) -> dict:
    """Re-runs the faulted workdir to the end; what it printed and what it reached."""
    code, output = _run("none", workdir, cache_dir)
    return {"code": code, "output": output,
            "outcome": _outcome(workdir) if code == 0 else None}


def _assert_resumed_bitwise(resumed: dict, reference: dict) -> None:
    assert resumed["code"] == 0, resumed["output"]
    assert "Traceback" not in resumed["output"], resumed["output"]
    got = resumed["outcome"]
    assert got["losses"] == reference["losses"]  # bitwise: the same floats
    assert got["params"] == reference["params"]
    assert got["final"] == reference["final"]


def _wait_for(log: Path, proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before the kill point:\n{log.read_text()}")
        if ready(log.read_text() if log.exists() else ""):
            return
        time.sleep(0.005)
    raise AssertionError(f"kill point not reached in {timeout} s:\n{log.read_text()}")


# name -> (fault injected by the worker, when to SIGKILL from here: None = the worker does)
KILL_POINTS = {
    "set-up": ("none", lambda w, text: w.exists()),  # the workdir is made first thing
    "compilation": ("none", lambda w, text: "config overrides" in text),  # then the step compiles
    "training": ("none", lambda w, text: "step 14/30" in text),
    "inside an async save": ("kill_in_save:20", None),
    "just after a commit": ("none", lambda w, text: (w / "checkpoints" / "20").is_dir()),
    "final decode": ("none", lambda w, text: "step 30/30" in text),
}
SIGNALS = {"SIGINT_in_eval:2": 20, "SIGTERM_in_save:10": 10}  # fault -> the step it stops at


def _kill(point: str, workdir: Path, cache_dir: Path) -> dict:
    fault, ready = KILL_POINTS[point]
    proc, log = _start(fault, workdir, cache_dir)
    if ready is not None:
        _wait_for(log, proc, lambda text: ready(workdir, text))
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=240)
    return {"code": proc.returncode, "output": log.read_text()}


def _fault(fault: str, workdir: Path, cache_dir: Path) -> dict:
    code, output = _run(fault, workdir, cache_dir, timeout=120)
    found = {"code": code, "output": output, "steps": Checkpointer(workdir, read_only=True)
             .all_steps(), "final": (workdir / "final_metrics.json").exists()}
    found["kept"] = {s: _digests(workdir / "checkpoints" / str(s)) for s in found["steps"]}
    return found


@pytest.fixture(scope="module")
def scenarios(reference, tmp_path_factory, cache_dir) -> dict[str, dict]:
    """Every fault that needs no mount, each faulted then resumed, two runs at a time
    (2 cores): {name: {"fault": what the faulted run left, "resumed": ..., "kept":
    the digests of its checkpoints after resuming}}."""
    root = tmp_path_factory.mktemp("scenarios")
    jobs = {**{f"kill {p}": (lambda w, p=p: _kill(p, w, cache_dir)) for p in KILL_POINTS},
            **{f: (lambda w, f=f: _fault(f, w, cache_dir)) for f in (*SIGNALS,
                                                                      "enospc_in_save:20")}}

    def one(name: str) -> dict:
        workdir = root / name.replace(" ", "_").replace(":", "_")
        faulted = jobs[name](workdir)
        resumed = _resume(workdir, cache_dir)
        kept = {s: _digests(workdir / "checkpoints" / str(s)) for s in faulted.get("kept", {})}
        return {"fault": faulted, "resumed": resumed, "kept": kept, "workdir": workdir}

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_at_any_moment_resumes_bitwise(point, scenarios, reference):
    found = scenarios[f"kill {point}"]
    assert found["fault"]["code"] == -signal.SIGKILL, found["fault"]["output"]
    _assert_resumed_bitwise(found["resumed"], reference)


@pytest.mark.parametrize("fault", list(SIGNALS))
def test_signal_during_eval_or_save_saves_stops_and_resumes_bitwise(fault, scenarios, reference):
    found, stop_step = scenarios[fault], SIGNALS[fault]
    faulted = found["fault"]
    assert faulted["code"] == 0, faulted["output"]
    assert "Traceback" not in faulted["output"], faulted["output"]
    assert f"stopped at step {stop_step} after a signal; checkpoint saved" in faulted["output"]
    assert faulted["steps"][-1] == stop_step and not faulted["final"]
    assert found["kept"] == faulted["kept"]  # resuming rewrote none of them
    _assert_resumed_bitwise(found["resumed"], reference)


def _check_failed_save(workdir: Path, code: int, output: str, step: int, kept: list[int]) -> None:
    assert code == 1, output
    line = _error_line(output)
    assert f"saving checkpoint step {step} to {workdir / 'checkpoints' / str(step)} failed: " \
           "No space left on device [errno 28]" in line, line
    assert line.endswith(f"checkpoint {kept[0]} is kept" if len(kept) == 1 else
                         f"checkpoints {', '.join(map(str, kept))} are kept"), line
    for s in kept:
        restore_checkpoint(workdir, s)  # intact: checksums verified


def test_failed_async_save_stops_at_once_naming_step_path_and_error(scenarios, reference):
    found = scenarios["enospc_in_save:20"]
    faulted = found["fault"]
    assert faulted["steps"] == [10]
    _check_failed_save(found["workdir"], faulted["code"], faulted["output"], 20, [10])
    assert "step 30/30" not in faulted["output"]  # stopped within the steps the save took
    assert found["kept"] == faulted["kept"]  # the kept checkpoint, byte for byte
    _assert_resumed_bitwise(found["resumed"], reference)


@contextlib.contextmanager
def _tmpfs(size: str):
    """A tmpfs of `size` mounted on a fresh directory; skips where mounting is refused."""
    where = Path(tempfile.mkdtemp(prefix="zoo_tmpfs_"))
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, text=True)
    except FileNotFoundError:
        done = None
    if done is None or done.returncode != 0:
        where.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): "
                    + (done.stderr.strip() if done else "no mount command"))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def _remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def test_full_disk_stops_with_one_line_and_resumes_once_there_is_space(
        reference, cache_dir):
    # One checkpoint of the tiny model takes ~0.66 MB: 1.6 MB hold steps 10 and 20 only.
    with _tmpfs("1600k") as disk:
        workdir = disk / "run"
        proc, log = _start("none", workdir, cache_dir)
        proc.wait(timeout=120)
        output = log.read_text()
        steps = Checkpointer(workdir, read_only=True).all_steps()
        assert steps and steps[-1] < 30, output
        _check_failed_save(workdir, proc.returncode, output, steps[-1] + 10, steps)
        before = {s: _digests(workdir / "checkpoints" / str(s)) for s in steps}
        _remount(disk, "size=64m")
        _assert_resumed_bitwise(_resume(workdir, cache_dir), reference)
        assert {s: _digests(workdir / "checkpoints" / str(s)) for s in steps} == before


def _decode(workdir: Path, cache_dir: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "transformer_zoo.train.decode",
                           f"--workdir={workdir}", "--input=-"], cwd=ROOT, env=_env(cache_dir),
                          input="1204\n37\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_read_only_workdir_is_one_line_for_training_and_decodes(reference, cache_dir):
    with _tmpfs("64m") as disk:
        workdir = disk / "run"
        code, output = _run("none", workdir, cache_dir, "--config.train.num_steps=20")
        assert code == 0, output
        before = {s: _digests(workdir / "checkpoints" / str(s)) for s in (10, 20)}
        want = _decode(workdir, cache_dir)
        _remount(disk, "ro")
        for case in (("--config.train.num_steps=20",),  # re-run of the finished run
                     ("--config.train.num_steps=30",)):  # resume to train on
            code, output = _run("none", workdir, cache_dir, *case)
            assert code == 1, output
            line = _error_line(output)
            assert line == f"error: --workdir {workdir} is not writable ({workdir}: " \
                           "Read-only file system)", line
        assert _decode(workdir, cache_dir) == want and len(want) == 2
        assert {s: _digests(workdir / "checkpoints" / str(s)) for s in (10, 20)} == before


def test_decoders_read_while_the_trainer_deletes_checkpoints(tmp_path, cache_dir):
    """keep_checkpoints=1 and a checkpoint every step: each step deletes the one a
    decoder may be reading; every read must still return a whole, verified step."""
    workdir = tmp_path / "run"
    proc, log = _start("none", workdir, cache_dir, "--config.train.num_steps=40",
                       "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=1",
                       "--config.train.eval_every=0", "--config.data.num_decode_examples=0")
    _wait_for(log, proc, lambda text: Checkpointer(workdir, read_only=True).all_steps())
    read, errors = [], []
    stop = threading.Event()

    def decode_loop():
        while not stop.is_set():
            try:
                read.append(restore_checkpoint(workdir).step)
            except Exception as err:  # noqa: BLE001 (each failure is the test's finding)
                errors.append(f"{type(err).__name__}: {err}")

    reader = threading.Thread(target=decode_loop)
    reader.start()
    try:
        proc.wait(timeout=240)
    finally:
        stop.set()
        reader.join()
    assert proc.returncode == 0, log.read_text()
    assert not errors, errors[:3]
    assert len(read) >= 5 and read == sorted(read), read


def test_decoding_reads_in_place_where_hard_links_are_refused(tmp_path, cache_dir, monkeypatch):
    """A file system without hard links (os.link: EPERM) still decodes: in place."""
    import errno as errno_module

    workdir = tmp_path / "run"
    code, output = _run("none", workdir, cache_dir, "--config.train.num_steps=10",
                        "--config.data.num_decode_examples=0")
    assert code == 0, output
    want = restore_checkpoint(workdir)

    def refuse(*_):
        raise OSError(errno_module.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    got = restore_checkpoint(workdir)
    assert got.step == want.step == 10
    jax.tree.map(np.testing.assert_array_equal, got.params, want.params)
    assert not list(workdir.glob(".pinned-*"))  # nothing left behind

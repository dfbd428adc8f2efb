"""One trainer per workdir: a live holder is refused, a stale lock is taken over."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.train import tiny_config
from transformer_zoo.train.loop import train_and_evaluate
from transformer_zoo.train.workdir_lock import LOCK_FILE, WorkdirBusyError, exclusive


def _config():
    config = tiny_config.get_config()
    config.train.num_steps = 2
    config.data.num_decode_examples = 0
    return config


def _lock(workdir, pid, host=None):
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or
                                                 socket.gethostname()}))


def test_a_live_trainer_holds_the_workdir_and_nothing_is_written(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _lock(tmp_path / "run", other.pid)
        with pytest.raises(WorkdirBusyError, match=f"in use by another trainer, process "
                                                   f"{other.pid}"):
            train_and_evaluate(_config(), tmp_path / "run")
        assert os.listdir(tmp_path / "run") == [LOCK_FILE]  # its lock, and nothing else
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == other.pid
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over_and_a_finished_run_leaves_none(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _lock(tmp_path / "run", gone.pid)
    train_and_evaluate(_config(), tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_lock_of_another_host_is_refused_naming_it(tmp_path):
    _lock(tmp_path, 1, host="elsewhere")
    with pytest.raises(WorkdirBusyError, match="held by process 1 on host elsewhere"), \
            exclusive(tmp_path):
        pass
    (tmp_path / "other").mkdir()
    with exclusive(tmp_path / "other") as path:  # another workdir locks normally
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()

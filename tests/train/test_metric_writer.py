"""MetricWriter on disk: complete rows only, and a failing disk named in the error."""

from __future__ import annotations

import errno
import json

import pytest

from transformer_zoo.train.metrics import MetricWriter


def test_a_row_cut_short_by_a_kill_is_dropped_on_reopening(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"step": 1, "split": "train", "loss": 2.5}) + "\n"
    path.write_text(good + '{"step": 2, "split": "tr')  # what a SIGKILL mid-write leaves
    writer = MetricWriter(tmp_path, enabled=True)
    writer.write(2, "train", {"loss": 2.25})
    writer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.5), (2, 2.25)]
    MetricWriter(tmp_path, enabled=True).close()  # complete rows: nothing is dropped
    assert len(path.read_text().splitlines()) == 2


def test_a_failed_write_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    writer = MetricWriter(tmp_path, enabled=True)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer._jsonl, "flush", full)
    with pytest.raises(OSError, match=r"writing .*metrics\.jsonl failed: No space left") as err:
        writer.write(1, "train", {"loss": 1.0})
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    writer.close()

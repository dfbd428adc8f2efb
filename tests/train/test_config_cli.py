"""The training CLI refuses a misspelt or bad config field with exit code 1, one line on
stderr and nothing written in the workdir (before any work)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.train import tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,match", [
    # Refused while the flags are parsed (ml_collections' 'did you mean').
    ("--config.data.num_train_exmples=5", 'Did you mean "num_train_examples"'),
    # Refused by configs/schema.py's check, before the tokenizer and data.
    ("--config.decode.metric=blue", "decode.metric='blue' is unknown; choose from"),
    # The optimizer's choices too (they used to fail after the tokenizer was written).
    ("--config.optim.schedule=nope", "optim.schedule='nope' is unknown; choose from"),
])
def test_a_misspelt_field_exits_1_with_one_line_and_writes_nothing(tmp_path, override, match):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_zoo.train", f"--config={tiny_config.__file__}",
         f"--workdir={workdir}", override], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert "Traceback" not in proc.stderr and not workdir.exists()

"""benchmarks/accelerator.py: its --smoke dry run works here, and without a GPU it says so."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accelerator.py"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, check=False, timeout=120)


def _table_rows(stdout: str) -> list[list[str]]:
    """The cells of every markdown table row, header and separator lines excluded."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in stdout.splitlines() if line.startswith("| ")]
    return [r for r in rows if r[0] not in ("T", "masks", "---")]


def test_smoke_run_prints_attention_and_dropout_tables():
    out = _run("--smoke", "--sections", "attention,dropout")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _table_rows(out.stdout)
    impls = {r[1]: r for r in rows if r[0].isdigit()}
    assert set(impls) == {"xla", "cudnn", "pallas"}, out.stdout
    # The reference row has numbers: bfloat16's own error against float32, a time.
    xla = impls["xla"]
    assert 0 < float(xla[2]) < 0.1 and 0 < float(xla[3]) < 0.1, xla
    assert float(xla[4]) > 0 and xla[5] == "1.00x", xla
    masks = {(r[0], r[1]) for r in rows if r[0] in ("hash", "threefry")}
    assert masks == {(m, mode) for m in ("hash", "threefry")
                     for mode in ("forward", "forward + backward")}, out.stdout
    assert "train step" not in out.stdout and "decode" not in out.stdout


def test_without_a_gpu_it_exits_1_with_one_line():
    out = _run(JAX_PLATFORMS="cpu")
    assert out.returncode == 1
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("accelerator.py:")]
    assert lines == ["accelerator.py: no GPU visible (jax.devices() -> [CpuDevice(id=0)]); "
                     "run it on a GPU machine, or pass --smoke for a tiny CPU dry run"]

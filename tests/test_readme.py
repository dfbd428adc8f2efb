"""Every ```python block of README.md runs, so an example there cannot rot.

Each block runs alone in a fresh interpreter whose working directory is an empty
temporary folder, so it imports the installed `transformer_zoo`, never the
repository's top-level folders, and can rely on nothing another block defined.
A block that must not run would need the line `<!-- readme: no-run -->` right
above its fence; the README has none, and it should stay that way.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NO_RUN = "<!-- readme: no-run -->"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
TIMEOUT_S = 300  # each block is meant to take a few seconds; this only stops a hang


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(1-based line of the opening fence, code) for each ```python block to run."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() != NO_RUN:
            blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks():
    assert BLOCKS, f"no ```python block found in {README}: the test below would run nothing"


def test_block_extraction():
    text = "x\n```python\na = 1\n```\n" + NO_RUN + "\n```python\nb = 2\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n")]


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path):
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
    head = "\n".join(f"    {s}" for s in code.splitlines()[:8])
    assert proc.returncode == 0, (
        f"README.md block at line {line} exited with {proc.returncode}.\n"
        f"  It begins:\n{head}\n  stderr (last 4000 characters):\n{proc.stderr[-4000:]}"
    )

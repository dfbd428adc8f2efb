"""Huge pages for XLA's per-call buffers (train/host_memory.py); user settings win.

The page-fault checks run in fresh subprocesses: glibc reads its tunables only
at process start.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_zoo.train import host_memory

ROOT = Path(__file__).resolve().parents[2]

# A program with a 72 MiB temporary buffer, above glibc's largest mmap threshold
# (32 MiB): each call maps the buffer afresh and the kernel faults it in.
_PROBE = """
import json, os, resource
import jax, jax.numpy as jnp
x = jnp.ones((16 * 2**20,), jnp.float32)
program = jax.jit(lambda v: jnp.sum(jnp.cumsum(v) * v)).lower(x).compile()
for _ in range(3):
    program(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    program(x).block_until_ready()
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"),
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "temp_pages": program.memory_analysis().temp_size_in_bytes // 4096}))
"""


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not host_memory.user_configured({k: v})}
    return {**env, "JAX_PLATFORMS": "cpu"}


def _run(code: str, env: dict) -> list[str]:
    """The stdout lines of `python -c code`, which must succeed."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


@pytest.mark.skipif(not host_memory.huge_pages_supported(),
                    reason="needs glibc >= 2.35 and transparent huge pages in madvise mode")
def test_the_tunable_cuts_page_faults_of_xla_buffers():
    base = _clean_env()
    extra = host_memory.huge_page_env(base)
    assert extra == {"GLIBC_TUNABLES": host_memory.TUNABLE}
    default = json.loads(_run(_PROBE, base)[-1])
    huge = json.loads(_run(_PROBE, {**base, **extra})[-1])
    assert huge["tunables"] == host_memory.TUNABLE
    # By default all 4 KiB pages of the buffer fault in every call; with 2 MiB
    # pages 1/512 of them would (measured: ~1/30 with everything else the
    # process touches).
    assert default["faults"] >= 10 * 0.9 * default["temp_pages"], default
    assert huge["faults"] <= 10 * 0.2 * huge["temp_pages"], huge


def test_restart_sets_the_tunable_once():
    code = ("import os\n"
            "from transformer_zoo.train import host_memory\n"
            "host_memory.huge_pages_supported = lambda: True\n"
            "print('start', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
            "host_memory.restart_with_huge_pages()\n"
            "print('running', os.environ.get('GLIBC_TUNABLES'))\n")
    assert _run(code, _clean_env()) == ["start None", f"start {host_memory.TUNABLE}",
                                        f"running {host_memory.TUNABLE}"]


def test_user_settings_and_accelerators_are_left_alone(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_pages_supported", lambda: True)
    assert host_memory.huge_page_env({"JAX_PLATFORMS": "cpu"}) == {
        "GLIBC_TUNABLES": host_memory.TUNABLE}
    for name in ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_"):
        assert host_memory.huge_page_env({"JAX_PLATFORMS": "cpu", name: "1"}) == {}, name
    assert host_memory.huge_page_env({"JAX_PLATFORMS": "cuda,cpu"}) == {}
    monkeypatch.setattr(host_memory, "huge_pages_supported", lambda: False)
    assert host_memory.huge_page_env({"JAX_PLATFORMS": "cpu"}) == {}


def test_cpu_backend_expected_reads_jax_platforms_and_plugins(monkeypatch):
    assert host_memory.cpu_backend_expected({"JAX_PLATFORMS": "cpu"})
    assert not host_memory.cpu_backend_expected({"JAX_PLATFORMS": "tpu"})
    # Unset: an installed accelerator plugin means jax may not run on the CPU.
    monkeypatch.setattr(host_memory.importlib.metadata, "entry_points",
                        lambda group: ["jax_cuda12_plugin"] if group == "jax_plugins" else [])
    assert not host_memory.cpu_backend_expected({})


@pytest.mark.parametrize("mode, expected", [("always [madvise] never", True),
                                            ("[always] madvise never", False),
                                            ("always madvise [never]", False)])
def test_huge_pages_supported_needs_madvise_mode(tmp_path, monkeypatch, mode, expected):
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    monkeypatch.setattr(host_memory, "glibc_version", lambda: (2, 36))
    mode_file = tmp_path / "enabled"
    mode_file.write_text(mode + "\n")
    assert host_memory.huge_pages_supported(str(mode_file)) is expected
    for old_or_other in ((2, 31), None):
        monkeypatch.setattr(host_memory, "glibc_version", lambda v=old_or_other: v)
        assert host_memory.huge_pages_supported(str(mode_file)) is False


def test_glibc_version_reads_the_running_library(monkeypatch):
    monkeypatch.setattr(host_memory.os, "confstr", lambda name: "glibc 2.36")
    assert host_memory.glibc_version() == (2, 36)
    monkeypatch.setattr(host_memory.os, "confstr", lambda name: "musl 1.2")
    assert host_memory.glibc_version() is None

    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(host_memory.os, "confstr", unknown)
    assert host_memory.glibc_version() is None


def test_python_m_train_restarts_before_numpy_or_jax():
    code = ("import sys, runpy\n"
            "import transformer_zoo.train.host_memory as hm\n"
            "seen = []\n"
            "hm.restart_with_huge_pages = lambda: seen.append(\n"
            "    sorted(m for m in ('numpy', 'jax') if m in sys.modules))\n"
            "sys.argv = ['train', '--helpshort']\n"
            "try:\n"
            "    runpy.run_module('transformer_zoo.train', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(seen)\n")
    assert _run(code, _clean_env())[-1] == "[[]]"

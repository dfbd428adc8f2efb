"""Huge pages for XLA:CPU's per-step buffers, so they are not faulted in 4 KiB at a time.

XLA:CPU allocates the temporary buffer of each execution with malloc and frees
it when the execution ends; for the benchmark train step (benchmarks/train_step.py)
that buffer is 228 MiB. glibc serves every allocation above 32 MiB with a fresh `mmap`
and unmaps it on free, so every step the kernel maps and zeroes the whole buffer again,
one 4 KiB page at a time: 62,000 page faults and ~0.13 s of system time per step on a
2-core AMD EPYC Zen 4, a sixth of the step's CPU time (benchmarks/README.md, "Page
faults of the per-step buffer").

With glibc's tunable `glibc.malloc.hugetlb=1` (glibc >= 2.35), malloc asks the
kernel for transparent huge pages on the blocks it maps, and the same buffer
takes ~600 faults. The benchmark step ran 1.10-1.17x faster with the same peak
RSS; the default recipe's training 2 min 20-24 s -> 2 min 2-15 s, peak RSS
0.90 -> 0.97-1.01 GB. Keeping freed memory in the heap instead
(`MALLOC_MMAP_MAX_=0` and one arena) was as fast, but fragmentation let the heap
grow by up to seven buffers' worth, so it is not used.

glibc reads tunables only at process start, so `python -m transformer_zoo.train` restarts
itself once with the tunable set (`restart_with_huge_pages`), before importing
numpy or jax. Nothing changes where the tunable would do nothing or the user
chose: not glibc >= 2.35, transparent huge pages not in `madvise` mode (with
`always` the kernel already uses them; with `never` it cannot), `GLIBC_TUNABLES`
or a `MALLOC_*` variable already set, or jax likely to pick an accelerator,
which allocates the step's buffers itself.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_",
                  "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_configured(environ=None) -> bool:
    """Whether the environment already sets glibc's malloc (then it is left alone)."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in _USER_SETTINGS)


def cpu_backend_expected(environ=None) -> bool:
    """Whether jax will run on its CPU backend, judged without importing jax."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    # Unset: jax takes an accelerator when a plugin for one is installed.
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    return not any(importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))


def glibc_version() -> tuple[int, ...] | None:
    """The running glibc's version, e.g. (2, 36); None for another C library."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(part) for part in version.split(".")) if name == "glibc" else None
    except (AttributeError, OSError, TypeError, ValueError):  # not glibc, or not POSIX
        return None


def huge_pages_supported(thp_mode_file: str = _THP_MODE) -> bool:
    """glibc >= 2.35 (the tunable) and transparent huge pages in `madvise` mode."""
    version = glibc_version()
    if not sys.platform.startswith("linux") or version is None or version < (2, 35):
        return False
    try:
        with open(thp_mode_file) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def huge_page_env(environ=None) -> dict[str, str]:
    """The variables to add for huge pages here: {} where nothing should change."""
    environ = os.environ if environ is None else environ
    if user_configured(environ) or not cpu_backend_expected(environ):
        return {}
    return {"GLIBC_TUNABLES": TUNABLE} if huge_pages_supported() else {}


def restart_with_huge_pages() -> None:
    """Re-run this process's command with `huge_page_env()` set; return if it is empty.

    Call it first thing in a program's entry point: the process is replaced
    (same PID and open files), so nothing done before the call survives.
    """
    extra = huge_page_env()
    if extra and sys.executable:
        # If it cannot re-run (e.g. the interpreter moved), it carries on as is.
        with contextlib.suppress(OSError):
            os.execve(sys.executable, sys.orig_argv, {**os.environ, **extra})

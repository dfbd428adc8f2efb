"""One trainer per workdir: a lock file naming the process that holds it.

Two trainers writing one workdir interleave their checkpoints and metrics, so
`python -m transformer_zoo.train` takes WORKDIR/trainer.lock (created
exclusively, holding the pid and host) before it writes anything, and removes
it when it ends. A lock whose process no longer runs on this host (a killed
trainer) is stale and taken over, with one log line. Decoders never lock: they
only read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from pathlib import Path

LOCK_FILE = "trainer.lock"

log = logging.getLogger("train")


class WorkdirBusyError(ValueError):
    """Another live trainer holds the workdir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable or half-written: its writer died mid-write


def _acquire(path: Path) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            pid, host = holder.get("pid"), holder.get("host")
            if isinstance(pid, int) and host != me["host"]:
                raise WorkdirBusyError(
                    f"{path.parent} is held by process {pid} on host {host} ({path}); if that "
                    "run is gone, delete the lock file") from None
            if isinstance(pid, int) and pid != me["pid"] and _alive(pid):
                raise WorkdirBusyError(
                    f"{path.parent} is in use by another trainer, process {pid} ({path})"
                ) from None
            log.warning("taking over the stale lock %s of process %s", path, pid)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return
    raise WorkdirBusyError(f"{path} was re-created while this trainer took it over")


@contextlib.contextmanager
def exclusive(workdir: str | os.PathLike):
    """Holds WORKDIR/trainer.lock for the duration (WorkdirBusyError if a live trainer has it)."""
    path = Path(workdir) / LOCK_FILE
    _acquire(path)
    try:
        yield path
    finally:
        if _holder(path).get("pid") == os.getpid():
            path.unlink(missing_ok=True)

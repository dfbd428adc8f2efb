"""`python -m transformer_zoo.train ...` with one fault injected at an exact moment.

    python tests/train/fault_worker.py FAULT [training command's flags...]

FAULT is one of:
  none                  no fault (the same process shape as the faulted runs)
  enospc_in_save:STEP   the background write of step STEP's data item fails
                        with OSError(ENOSPC), as a full disk makes it fail
  kill_in_save:STEP     SIGKILL inside step STEP's asynchronous save, while its
                        items are being written to the temporary directory
  SIGNAME_in_eval:N     SIGNAME (SIGINT, SIGTERM) at the start of the N-th evaluation
  SIGNAME_in_save:STEP  SIGNAME as the save of step STEP begins

The faults patch orbax's JSON item writer, `loop.evaluate` and `Checkpointer.save`
in this process only; the training code runs unchanged.
"""

from __future__ import annotations

import errno
import os
import runpy
import signal
import sys

# Huge pages would make the command re-execute itself; the tests do not need them.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")


def _in_step_dir(directory, step: int) -> bool:
    return any(part.startswith(f"{step}.orbax-checkpoint-tmp") or part == str(step)
               for part in str(directory).split(os.sep))


def _patch_json_writer(step: int, action) -> None:
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

    original = jch.JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
        if _in_step_dir(directory, step) and "data" in str(directory).split(os.sep)[-1]:
            action(directory)
        return await original(self, x, directory)

    jch.JsonCheckpointHandler._save_fn = save_fn


def _enospc(directory) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))


def _kill(directory) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _signal_at_eval(signum: int, n: int) -> None:
    from transformer_zoo.train import loop

    original, calls = loop.evaluate, [0]

    def evaluate(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    loop.evaluate = evaluate


def _signal_at_save(signum: int, step: int) -> None:
    from transformer_zoo.train.checkpoint import Checkpointer

    original = Checkpointer.save

    def save(self, at, *args, **kwargs):
        if at == step:
            os.kill(os.getpid(), signum)
        return original(self, at, *args, **kwargs)

    Checkpointer.save = save


def install(fault: str) -> None:
    if fault == "none":
        return
    name, _, value = fault.partition(":")
    number = int(value)
    if name == "enospc_in_save":
        _patch_json_writer(number, _enospc)
    elif name == "kill_in_save":
        _patch_json_writer(number, _kill)
    elif name.endswith("_in_eval"):
        _signal_at_eval(getattr(signal, name.removesuffix("_in_eval")), number)
    elif name.endswith("_in_save"):
        _signal_at_save(getattr(signal, name.removesuffix("_in_save")), number)
    else:
        raise SystemExit(f"fault_worker: unknown fault {fault!r}")


if __name__ == "__main__":
    fault = sys.argv.pop(1)
    install(fault)
    sys.argv[0] = "transformer_zoo.train"
    runpy.run_module("transformer_zoo.train", run_name="__main__", alter_sys=True)

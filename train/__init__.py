"""Training, checkpoints, evaluation and decoding commands.

The names below are imported on first use (PEP 562), so that `python -m train`
can configure the host allocator (train/host_memory.py) before numpy or jax
start any thread.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Checkpointer": "train.checkpoint",
    "average_checkpoints": "train.checkpoint",
    "average_params": "train.checkpoint",
    "NonFiniteLossError": "train.loop",
    "train_and_evaluate": "train.loop",
    "label_smoothed_cross_entropy": "train.losses",
    "smoothing_floor": "train.losses",
    "summarize": "train.losses",
    "make_schedule": "train.schedules",
    "rsqrt_warmup": "train.schedules",
    "TrainState": "train.state",
    "create_train_state": "train.state",
    "make_optimizer": "train.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

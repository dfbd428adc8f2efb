"""Training, checkpoints, evaluation and decoding commands.

The names below are imported on first use (PEP 562), so that `python -m transformer_zoo.train`
can configure the host allocator (train/host_memory.py) before numpy or jax
start any thread.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BestMode": "transformer_zoo.train.checkpoint",
    "Checkpointer": "transformer_zoo.train.checkpoint",
    "average_checkpoints": "transformer_zoo.train.checkpoint",
    "average_params": "transformer_zoo.train.checkpoint",
    "chunked_output_loss": "transformer_zoo.train.chunked_loss",
    "NonFiniteLossError": "transformer_zoo.train.loop",
    "train_and_evaluate": "transformer_zoo.train.loop",
    "label_smoothed_cross_entropy": "transformer_zoo.train.losses",
    "smoothing_floor": "transformer_zoo.train.losses",
    "summarize": "transformer_zoo.train.losses",
    "Schedule": "transformer_zoo.train.schedules",
    "make_schedule": "transformer_zoo.train.schedules",
    "DecodeMetric": "transformer_zoo.train.scores",
    "bleu_chrf": "transformer_zoo.train.scores",
    "exact_match": "transformer_zoo.train.scores",
    "rsqrt_warmup": "transformer_zoo.train.schedules",
    "Optimizer": "transformer_zoo.train.state",
    "TrainState": "transformer_zoo.train.state",
    "create_train_state": "transformer_zoo.train.state",
    "make_optimizer": "transformer_zoo.train.state",
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

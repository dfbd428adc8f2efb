"""Training, checkpoints, evaluation and decoding commands."""

from train.checkpoint import Checkpointer, average_checkpoints, average_params
from train.loop import NonFiniteLossError, train_and_evaluate
from train.losses import label_smoothed_cross_entropy, smoothing_floor, summarize
from train.schedules import make_schedule, rsqrt_warmup
from train.state import TrainState, create_train_state, make_optimizer

__all__ = [
    "Checkpointer",
    "NonFiniteLossError",
    "TrainState",
    "average_checkpoints",
    "average_params",
    "create_train_state",
    "label_smoothed_cross_entropy",
    "make_optimizer",
    "make_schedule",
    "rsqrt_warmup",
    "smoothing_floor",
    "summarize",
    "train_and_evaluate",
]

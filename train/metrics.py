"""Metric sinks: console progress line, metrics.jsonl and TensorBoard events.

Only process 0 writes (multi-host runs call this on every process). Besides
scalars, TensorBoard gets text (decoded samples), images (PNG files or
arrays: attention maps, training curves) and the run config as hyperparameters.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger("train")


class MetricWriter:
    """Writes scalars to WORKDIR/metrics.jsonl and WORKDIR/tensorboard."""

    def __init__(self, workdir, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = None
        self._tb = None
        if self.enabled:
            Path(workdir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(workdir) / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "split": split, "time": time.time()}
        row.update({k: float(v) for k, v in scalars.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for name, value in scalars.items():
            self._tb.add_scalar(f"{split}/{name}", float(value), int(step))

    def write_text(self, step: int, tag: str, text: str) -> None:
        """Text under `tag` at `step` (TensorBoard renders it as markdown)."""
        if self.enabled:
            self._tb.add_text(tag, text, int(step))

    def write_image(self, step: int, tag: str, image) -> None:
        """An image under `tag` at `step`.

        Args:
          step: the training step.
          tag: its TensorBoard name, e.g. "final/curves".
          image: a PNG file's path, or an [H, W] / [H, W, 3|4] array (uint8, or
            float in [0, 1]).

        Raises:
          ValueError: an array of another rank or channel count.
        """
        if not self.enabled:
            return
        if isinstance(image, (str, Path)):
            from matplotlib import image as mpimg

            image = mpimg.imread(Path(image))  # float [H, W, 3|4] in [0, 1]
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[..., None]
        if pixels.ndim != 3 or pixels.shape[-1] not in (1, 3, 4):
            raise ValueError(f"write_image: image must be [H, W] or [H, W, 1|3|4], got shape "
                             f"{pixels.shape}")
        self._tb.add_image(tag, pixels, int(step), dataformats="HWC")

    def write_hparams(self, config_dict: Mapping[str, Any], metrics: Iterable[str] = ()) -> None:
        """The run config as TensorBoard hyperparameters (the HParams dashboard), in this
        run's own event file; call it once, at the start.

        Args:
          config_dict: the run config as nested dicts (`config.to_dict()`), flattened to
            "model.d_model"-style names; values that are not bool, int, float or str are
            written as their str(), None as "None".
          metrics: tags of scalars this run writes (e.g. "eval/loss") that the dashboard
            shows beside the hyperparameters.
        """
        if not self.enabled:
            return
        from tensorboardX.summary import hparams

        # SummaryWriter.add_hparams would write them to a new subfolder, which TensorBoard
        # shows as another run; these summaries attach them to this run's own scalars.
        experiment, start, _ = hparams(_flat_hparams(config_dict), {tag: 0.0 for tag in metrics})
        writer = self._tb._get_file_writer()
        writer.add_summary(experiment)
        writer.add_summary(start)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def _flat_hparams(tree: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested config dicts as {"section.field": value} with TensorBoard's value types."""
    out: dict[str, bool | int | float | str] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            out.update(_flat_hparams(value, f"{key}."))
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
        else:
            out[key] = str(value)
    return out


class Progress:
    """The console line: step, loss, learning rate, tokens/s, ETA."""

    def __init__(self, start_step: int, total_steps: int):
        self.total = total_steps
        self.last_step = start_step
        self.last_time = time.perf_counter()
        self.start_time = self.last_time
        self.start_step = start_step

    def line(self, step: int, loss: float, lr: float, tokens: float) -> str:
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        recent = elapsed / max(step - self.last_step, 1)
        average = (now - self.start_time) / max(step - self.start_step, 1)
        self.last_step, self.last_time = step, now
        return (f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.3e}  "
                f"{tokens / elapsed:,.0f} tok/s  {1000 * recent:.0f} ms/step  "
                f"ETA {_hms(average * (self.total - step))}")


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileTimer:
    """Sums JAX's tracing, lowering and XLA compile time while it is active.

    `with CompileTimer() as timer: ...; timer.seconds` (reported at the end of a run).
    """

    def __init__(self):
        self.seconds = 0.0
        self.compiles = 0

    def _listen(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration
            self.compiles += event == COMPILE_EVENTS[-1]

    def __enter__(self) -> CompileTimer:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)

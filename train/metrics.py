"""Metric sinks: console progress line, metrics.jsonl and TensorBoard events.

Only process 0 writes (multi-host runs call this on every process). Besides
scalars, TensorBoard gets text (decoded samples), images (PNG files or
arrays: attention maps, training curves) and the run config as hyperparameters.
"""

from __future__ import annotations

import contextlib
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
    """Writes scalars to WORKDIR/metrics.jsonl and WORKDIR/tensorboard.

    Every write reaches the file before it returns (TensorBoard events too:
    tensorboardX's own SummaryWriter queues them for a thread that dies on a
    full disk, after which the queue fills and the trainer blocks forever), so
    a failing disk is an OSError naming the file, raised in the caller. A row
    cut short by a kill is dropped when the file is next opened, so
    metrics.jsonl only ever holds complete rows.
    """

    def __init__(self, workdir, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = None
        self._events = None
        if self.enabled:
            Path(workdir).mkdir(parents=True, exist_ok=True)
            self._jsonl_path = Path(workdir) / "metrics.jsonl"
            _drop_partial_row(self._jsonl_path)
            self._jsonl = open(self._jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
            from tensorboardX.event_file_writer import EventsWriter

            folder = Path(workdir) / "tensorboard"
            folder.mkdir(exist_ok=True)
            with _naming(folder):
                self._events = EventsWriter(str(folder / "events"))
            self._events_path = Path(self._events._file_name)

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        from tensorboardX.summary import scalar

        row = {"step": int(step), "split": split, "time": time.time()}
        row.update({k: float(v) for k, v in scalars.items()})
        with _naming(self._jsonl_path):
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        self._add([scalar(f"{split}/{name}", float(value)) for name, value in scalars.items()],
                  step)

    def write_text(self, step: int, tag: str, text: str) -> None:
        """Text under `tag` at `step` (TensorBoard renders it as markdown)."""
        if self.enabled:
            from tensorboardX.summary import text as text_summary

            self._add([text_summary(tag, text)], step)

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
        from tensorboardX.summary import image as image_summary

        if isinstance(image, (str, Path)):
            from matplotlib import image as mpimg

            image = mpimg.imread(Path(image))  # float [H, W, 3|4] in [0, 1]
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[..., None]
        if pixels.ndim != 3 or pixels.shape[-1] not in (1, 3, 4):
            raise ValueError(f"write_image: image must be [H, W] or [H, W, 1|3|4], got shape "
                             f"{pixels.shape}")
        self._add([image_summary(tag, pixels, dataformats="HWC")], step)

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
        self._add([experiment, start], None)

    def _add(self, summaries, step: int | None) -> None:
        """Writes each summary as one event and flushes them to the file."""
        from tensorboardX.proto import event_pb2

        with _naming(self._events_path):
            for summary in summaries:
                event = event_pb2.Event(summary=summary, wall_time=time.time())
                if step is not None:
                    event.step = int(step)
                self._events.write_event(event)
            self._events.flush()

    def close(self) -> None:
        if self.enabled:
            with _naming(self._jsonl_path):
                self._jsonl.close()
            with _naming(self._events_path):
                self._events.close()


@contextlib.contextmanager
def _naming(path: Path):
    """Re-raises an OSError without a file name (a failed write or flush) with `path`."""
    try:
        yield
    except OSError as err:
        if err.filename or err.errno is None:
            raise
        raise OSError(err.errno, f"writing {path} failed: {err.strerror}") from err


def _drop_partial_row(path: Path, tail: int = 1 << 16) -> None:
    """Truncates `path` after its last newline (drops a row a kill cut short), if any."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        size = f.seek(0, 2)
        start = max(size - tail, 0)  # a row is far shorter than `tail`
        f.seek(start)
        content = f.read()
        if content.endswith(b"\n"):
            return
        keep = start + content.rfind(b"\n") + 1 if b"\n" in content else start
        log.warning("%s: dropping a row cut short (%d bytes)", path, size - keep)
        f.truncate(keep)


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

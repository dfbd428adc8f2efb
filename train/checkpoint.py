"""Orbax checkpoints: save, resume, restore params only, average.

A checkpoint step holds four items:
  params     the model parameters (all decoding needs)
  opt_state  the optax state
  meta       step and PRNG key
  data       the data iterator state (JSON)
and every checkpoint directory also holds `config` (JSON: the run config and
the resolved model config) and `checksums` (JSON: a crc32 of the bytes of every
saved array of params and opt_state, computed on the host values that were
saved). Orbax writes each step to a temporary directory and renames it when
complete, so a partially written step is never listed or restored.

Restores prove what they read: a step is first inspected (every item present,
its metadata parseable), then restored item by item and its arrays' checksums
recomputed and compared. Any failure is a DamagedCheckpointError (a ValueError) that
names the step, the file and the reason. `restore_latest_intact` (training
resume) moves damaged newer steps aside to `<step>.damaged` (never deleted)
and restores the newest intact one. Steps written before checksums existed
restore with a warning.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from transformer_zoo.models.variants import parse

ARRAY_ITEMS = ("params", "opt_state", "meta")
TRAIN_ITEMS = ("params", "opt_state", "meta", "data", "config")  # what a resume reads
CHECKSUMS = "checksums"
DAMAGED_SUFFIX = ".damaged"

log = logging.getLogger("train")


class DamagedCheckpointError(ValueError):
    """A checkpoint step cannot be read back as saved (names the step, file and reason)."""

    def __init__(self, directory: Path, step: int, file: str, reason: str):
        self.directory, self.step, self.file = directory, step, file
        self.reason = " ".join(str(reason).split())[:300]  # one line, bounded
        super().__init__(f"checkpoint {directory} step {step} is damaged: {file}: {self.reason}")


class IncompatibleCheckpointError(ValueError):
    """An intact checkpoint of another model (not damage: nothing is moved aside)."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (no space, permission, I/O error).

    Names the step, its directory, the underlying error and the steps that
    are kept (they were committed before and are untouched: orbax writes a
    step to a temporary directory and renames it only when complete).
    """

    def __init__(self, directory: Path, step: int | None, cause: BaseException, kept: list[int]):
        self.directory, self.step, self.kept = directory, step, kept
        where = directory / str(step) if step is not None else directory
        cause_text = _os_error_text(cause) + " ".join(_root_cause(cause).split())[:240]
        kept_text = ("no earlier checkpoint exists" if not kept else
                     f"checkpoint {kept[0]} is kept" if len(kept) == 1 else
                     f"checkpoints {', '.join(map(str, kept))} are kept")
        super().__init__(f"saving checkpoint step {step} to {where} failed: {cause_text}; "
                         f"{kept_text}")


def checkpoint_dir(workdir: str | Path) -> Path:
    return Path(workdir).absolute() / "checkpoints"


class BestMode(enum.StrEnum):
    """Which value of `best_metric` is the best (the config's train.best_mode)."""

    MIN = "min"  # a loss
    MAX = "max"  # an accuracy or a BLEU score


class Checkpointer:
    """CheckpointManager wrapper: keep the last `keep` steps and the best one.

    Args:
      workdir: run directory; checkpoints go to workdir/checkpoints.
      keep: how many of the latest steps to keep.
      best_metric: metric name whose best step is kept as well (None: off).
      best_mode: a `BestMode` (or its value) for best_metric.
      async_save: save in a background thread (wait() before exit).
      read_only: open an existing directory for restoring only.
    """

    def __init__(self, workdir, *, keep: int = 3, best_metric: str | None = None,
                 best_mode: BestMode | str = BestMode.MIN, async_save: bool = True,
                 read_only: bool = False):
        best_mode = parse(BestMode, best_mode, "Checkpointer best_mode")
        policies = [pp.LatestN(keep)]
        self.best_metric = best_metric or None
        if best_metric:
            # Only steps saved with the metric compete; the others are LatestN's alone
            # (orbax's default keeps every step without metrics forever).
            policies.append(pp.BestN(get_metric_fn=lambda m: m[best_metric], n=1,
                                     reverse=best_mode == BestMode.MIN,
                                     keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=pp.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            read_only=read_only,
            create=not read_only,
        )
        self.directory = checkpoint_dir(workdir)
        handlers = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
        handlers.update({name: ocp.JsonCheckpointHandler() for name in
                         ("data", "config", CHECKSUMS)})
        for attempt in range(5):
            try:
                self.manager = ocp.CheckpointManager(self.directory, options=options,
                                                     item_handlers=handlers)
                break
            except FileNotFoundError:  # a live trainer deleted a step while it was listed
                if not read_only or attempt == 4:
                    raise
        self._in_flight: int | None = None  # the step an async save is writing

    def reload(self, attempts: int = 5) -> None:
        """Lists the steps again (orbax caches the list); a step deleted by a live
        trainer while it is being listed means listing once more."""
        for _ in range(attempts - 1):
            try:
                self.manager.reload()
                return
            except FileNotFoundError:
                continue
        self.manager.reload()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def candidate_steps(self) -> list[int]:
        """Orbax's steps and any other integer-named step directory (say one an
        interrupted copy left), oldest first: what a restore may consider."""
        named = {int(p.name) for p in self.directory.glob("*")
                 if p.is_dir() and p.name.isdigit()} if self.directory.is_dir() else set()
        return sorted(named | set(self.manager.all_steps()))

    def save(self, step: int, state, data_state: Mapping, config: Mapping,
             metrics: Mapping[str, float] | None = None) -> None:
        """Saves the train state, the data iterator state and the config at `step`.

        `metrics` are passed on (for keeping the best step) only when they hold
        the best metric.
        """
        sums = {"params": array_checksums(state.params),
                "opt_state": array_checksums(state.opt_state)}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.StandardSave({"step": state.step, "rng": state.rng}),
            data=ocp.args.JsonSave(dict(data_state)),
            config=ocp.args.JsonSave(dict(config)),
            checksums=ocp.args.JsonSave({"algorithm": "crc32", **sums}),
        )
        ranked = dict(metrics) if metrics and self.best_metric in metrics else None
        self._save(step, args, ranked)

    def save_params(self, step: int, params, config: Mapping) -> None:
        """A params-only checkpoint (e.g. an average), decodable but not resumable."""
        sums = {"algorithm": "crc32", "params": array_checksums(params)}
        args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                                  config=ocp.args.JsonSave(dict(config)),
                                  checksums=ocp.args.JsonSave(sums))
        self._save(step, args, None)

    def _save(self, step: int, args, metrics) -> None:
        """manager.save, any failure (of this save, or of the one before it still being
        written in the background) raised as CheckpointSaveError naming its step."""
        self.check_saves()
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as err:  # noqa: BLE001 (orbax raises what the file system did)
            failed, self._in_flight = self._in_flight or step, None
            raise self._save_error(failed, err) from err
        self._in_flight = step

    def check_saves(self) -> None:
        """Raises the error of a failed asynchronous save, once it has finished.

        Cheap enough for every training step: only when the save in flight has
        ended does it ask orbax for its error.

        Raises:
          CheckpointSaveError: the background save of `self._in_flight` failed.
        """
        if self._in_flight is None or self.manager.is_saving_in_progress():
            return
        step, self._in_flight = self._in_flight, None
        try:
            # Returns at once (nothing is running) but raises what the save's threads
            # raised; orbax's own finalize may have consumed check_for_errors' copy.
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as err:  # noqa: BLE001 (as in _save)
            raise self._save_error(step, err) from err
        if jax.process_index() == 0 and not (self.directory / str(step)).is_dir():
            raise self._save_error(step, FileNotFoundError(
                f"{self.directory / str(step)} was not committed (see the log above)"))

    def _save_error(self, step: int | None, err: BaseException) -> CheckpointSaveError:
        # A failed async save leaves orbax's pending write coroutine unawaited;
        # Python warns about it when the coroutine is collected (at exit, after
        # the error has been reported), a warning about orbax's internals that
        # no caller can act on.
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        with contextlib.suppress(Exception):  # the list is only for the message
            self.manager.reload()
        kept = [s for s in self._listed_steps() if s != step]
        return CheckpointSaveError(self.directory, step, err, kept)

    def _listed_steps(self) -> list[int]:
        try:
            return sorted(self.manager.all_steps())
        except Exception:  # noqa: BLE001 (a failing disk may fail listing too)
            return []

    def restore(self, step: int, state) -> tuple[Any, dict]:
        """Restores into the structure of `state` (arrays or ShapeDtypeStructs).

        Raises:
          IncompatibleCheckpointError: the checkpoint's parameters do not match
            `state.params` (names the first mismatched parameter and both shapes).
          DamagedCheckpointError: an item is missing, unreadable or fails its checksums.
        """
        self.inspect(step, TRAIN_ITEMS)
        self.check_compatible(step, state.params)
        meta_like = {"step": state.step, "rng": state.rng}
        params = self._restore_item(step, "params", ocp.args.StandardRestore(
            _abstract(state.params)))
        opt_state = self._restore_item(step, "opt_state", ocp.args.StandardRestore(
            _abstract(state.opt_state)))
        meta = self._restore_item(step, "meta", ocp.args.StandardRestore(_abstract(meta_like)))
        data = self._restore_item(step, "data", ocp.args.JsonRestore())
        if not isinstance(data, Mapping) or not data:
            raise DamagedCheckpointError(self.directory, step, "data/metadata",
                                   "empty data iterator state")
        self.restore_config(step)  # proves the config item readable too
        self.verify_checksums(step, {"params": params, "opt_state": opt_state})
        new_state = state.replace(params=params, opt_state=opt_state, step=meta["step"],
                                  rng=meta["rng"])
        return new_state, dict(data)

    def restore_latest_intact(self, state) -> tuple[int, Any, dict] | None:
        """(step, state, data state) of the newest intact step; None without any step.

        Damaged steps newer than it are logged (one line each) and moved aside to
        `<step>.damaged`, so later saves can reuse their numbers.

        Raises:
          ValueError: steps exist but none is intact (nothing is moved then).
        """
        damaged: list[DamagedCheckpointError] = []
        for step in reversed(self.candidate_steps()):
            try:
                new_state, data = self.restore(step, state)
            except DamagedCheckpointError as damage:
                log.warning("%s", damage)
                damaged.append(damage)
                continue
            for damage in damaged:
                self.move_aside(damage.step)
            return step, new_state, data
        if damaged:
            raise ValueError(f"{self.directory.parent} holds no intact checkpoint: "
                             + "; ".join(f"step {d.step}: {d.file}: {d.reason}" for d in damaged))
        return None

    def move_aside(self, step: int) -> Path:
        """Renames step directory `step` to `<step>.damaged` (never deletes it)."""
        source = self.directory / str(step)
        target = self.directory / f"{step}{DAMAGED_SUFFIX}"
        n = 0
        while target.exists():
            n += 1
            target = self.directory / f"{step}{DAMAGED_SUFFIX}.{n}"
        if jax.process_index() == 0:
            source.rename(target)
            log.warning("moved damaged checkpoint step %d aside to %s", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
        self.manager.reload()  # orbax caches its step list
        return target

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[Checkpointer]:
        """A read-only Checkpointer over hard links to the files of `step`.

        A live trainer's retention may delete `step` while a decoder reads it;
        the links keep its files (written once, never changed after commit)
        until the read ends, when they are removed. They live in a hidden
        `WORKDIR/.pinned-*` folder (hard links need the same file system).
        Where none can be made (a read-only workdir: no trainer is deleting
        there; a file system without hard links), this is `self`.

        Raises:
          DamagedCheckpointError: the step vanished while it was being linked
            (check whether its directory still exists to tell deletion from damage).
        """
        try:
            root = Path(tempfile.mkdtemp(prefix=".pinned-", dir=self.directory.parent))
        except OSError:
            yield self
            return
        try:
            try:
                self._link_step(step, checkpoint_dir(root) / str(step))
            except DamagedCheckpointError:
                raise
            except OSError:  # no hard links here (EPERM, EXDEV, ...): read in place
                linked = False
            else:
                linked = True
            yield Checkpointer(root, read_only=True, async_save=False) if linked else self
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _link_step(self, step: int, target: Path) -> None:
        source = self.directory / str(step)
        try:
            target.mkdir(parents=True)
            for path in sorted(source.rglob("*")):
                link = target / path.relative_to(source)
                if path.is_dir():
                    link.mkdir(parents=True, exist_ok=True)
                else:
                    link.parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, link)
        except FileNotFoundError as err:
            raise DamagedCheckpointError(self.directory, step, f"{step}/",
                                         f"deleted while being read ({err})") from err

    def restore_params(self, step: int, params_like) -> Any:
        """Restores only the parameters (no optimizer state is read), checksums verified."""
        self.inspect(step, ("params",))
        self.check_compatible(step, params_like)
        params = self._restore_item(step, "params", ocp.args.StandardRestore(
            _abstract(params_like)))
        self.verify_checksums(step, {"params": params})
        return params

    def restore_config(self, step: int) -> dict:
        self.inspect(step, ("config",))
        config = self._restore_item(step, "config", ocp.args.JsonRestore())
        if not isinstance(config, Mapping) or not config:
            raise DamagedCheckpointError(self.directory, step, "config/metadata", "empty config")
        return dict(config)

    def inspect(self, step: int, items) -> None:
        """Cheap structural check of `items` of `step` (files present and parseable).

        Raises:
          DamagedCheckpointError: names the first missing or unparseable file.
        """
        root = self.directory / str(step)
        damage = lambda file, why: DamagedCheckpointError(self.directory, step, file, why)
        if not root.is_dir():
            raise damage(f"{step}/", "no such step directory")
        if not any(root.iterdir()):
            raise damage(f"{step}/", "empty step directory (an interrupted copy?)")
        needed = ["_CHECKPOINT_METADATA"]
        for item in items:
            if not (root / item).is_dir():
                raise damage(f"{item}/", "missing item")
            if item in ARRAY_ITEMS:
                needed += [f"{item}/_METADATA", f"{item}/manifest.ocdbt"]
            else:
                needed.append(f"{item}/metadata")
        if (root / CHECKSUMS).exists():
            needed.append(f"{CHECKSUMS}/metadata")
        for name in needed:
            path = root / name
            if not path.is_file():
                raise damage(name, "missing")
            if path.stat().st_size == 0:
                raise damage(name, "empty file")
            if name.endswith("metadata") or name.endswith("_METADATA"):
                try:
                    json.loads(path.read_bytes())
                except (ValueError, UnicodeDecodeError) as err:
                    raise damage(name, f"unparseable JSON ({err})") from None

    def _restore_item(self, step: int, item: str, args) -> Any:
        """One item of `step`; all orbax or TensorStore raises is DamagedCheckpointError."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]
        except Exception as err:  # noqa: BLE001 (orbax raises ValueError, KeyError, OSError,
            # RuntimeError, json errors, even ImportError from TensorStore at shutdown)
            raise DamagedCheckpointError(self.directory, step, self._file_in(step, item, err),
                                         _root_cause(err)) from err

    def _file_in(self, step: int, item: str, err: Exception) -> str:
        """The step's file the error (or an error it came from) names, else the item's
        directory."""
        root = str(self.directory / str(step)) + "/"
        for seen in reversed(_chain(err)):
            found = re.search(re.escape(root) + r"[^\s'\",)]+", str(seen))
            if found:
                return found.group(0)[len(root):]
        return f"{item}/"

    def verify_checksums(self, step: int, restored: Mapping[str, Any]) -> None:
        """Recomputes the checksums of restored items and compares with the saved ones.

        Raises:
          DamagedCheckpointError: names the first array whose checksum differs.
        """
        if not (self.directory / str(step) / CHECKSUMS).exists():
            log.warning("checkpoint %s step %d has no checksums (written before they "
                        "existed): its arrays are not verified", self.directory, step)
            return
        saved = self._restore_item(step, CHECKSUMS, ocp.args.JsonRestore())
        for item, tree in restored.items():
            want, have = saved.get(item), array_checksums(tree)
            if not isinstance(want, Mapping):
                raise DamagedCheckpointError(self.directory, step, f"{CHECKSUMS}/metadata",
                                       f"no checksums for {item}")
            for name, value in have.items():
                if name not in want:
                    raise DamagedCheckpointError(self.directory, step, f"{item}/",
                                           f"{item} array {name} has no saved checksum")
                if value is not None and want[name] is not None and value != want[name]:
                    raise DamagedCheckpointError(self.directory, step, f"{item}/",
                                           f"checksum of {item} array {name} differs: saved "
                                           f"{want[name]}, restored {value}")

    def check_compatible(self, step: int, params_like) -> None:
        """Compares saved parameter shapes with the model's, before touching anything."""
        try:
            saved = self.manager.item_metadata(step)["params"]
        except Exception as err:  # noqa: BLE001 (as in _restore_item)
            raise DamagedCheckpointError(self.directory, step, self._file_in(step, "params", err),
                                   f"unreadable metadata: {type(err).__name__}: {err}") from err
        if not saved:
            raise DamagedCheckpointError(self.directory, step, "params/_METADATA",
                                   "no parameter metadata")
        saved_shapes = {k: tuple(v.shape) for k, v in _flatten(saved).items()}
        wanted = {k: tuple(np.shape(v)) for k, v in _flatten(params_like).items()}
        for name in sorted(set(saved_shapes) | set(wanted)):
            have, want = saved_shapes.get(name), wanted.get(name)
            if have != want:
                raise IncompatibleCheckpointError(
                    f"checkpoint {self.directory} step {step} is incompatible with this config: "
                    f"parameter {name} has shape {have} in the checkpoint but {want} in the model"
                )

    def wait(self) -> None:
        """Waits for a save in flight.

        Raises:
          CheckpointSaveError: it failed (names its step and the OS error).
        """
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 (as in _save)
            step, self._in_flight = self._in_flight, None
            raise self._save_error(step, err) from err
        self.check_saves()

    def close(self) -> None:
        self.manager.close()


def _flatten(tree) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in leaves}


def _chain(err: BaseException) -> list[BaseException]:
    """err and the exceptions it came from (TensorStore's detail is at the bottom)."""
    out: list[BaseException] = []
    while err is not None and len(out) < 8:
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def _os_error_text(err: BaseException) -> str:
    """"No space left on device [errno 28]: " for the first OS error in err's chain
    (an OSError's errno, or TensorStore's os_error_code='28'), else ""."""
    for seen in _chain(err):
        code = getattr(seen, "errno", None) if isinstance(seen, OSError) else None
        found = re.search(r"os_error_code='(\d+)'", str(seen))
        code = code if code is not None else int(found.group(1)) if found else None
        if code is not None:
            return f"{os.strerror(code)} [errno {code}]: "
    return ""


def _root_cause(err: BaseException) -> str:
    deepest = _chain(err)[-1]
    why = str(deepest).split(" See full TensorStore details")[0]
    return f"{type(deepest).__name__}: {why}"


def array_checksums(tree) -> dict[str, str | None]:
    """Per array of `tree` (by its path): "dtype[shape]:crc32" of its raw host bytes.

    An array that is not fully addressable (a multi-host shard: this process
    cannot see the whole value) gets None and is not verified on restore; every
    process would have to gather it to the host, which a save must not wait for.
    """
    out: dict[str, str | None] = {}
    for name, leaf in _flatten(tree).items():
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            out[name] = None
            continue
        value = np.ascontiguousarray(jax.device_get(leaf))
        out[name] = f"{value.dtype.str}{list(value.shape)}:{zlib.crc32(value.tobytes()):08x}"
    return out


def _abstract(tree):
    """Restore targets: each leaf's shape, dtype and sharding.

    A ShapeDtypeStruct without a sharding restores onto the first local device:
    left unset, orbax would reuse the saved sharding and fail on any other
    device topology (e.g. decoding on 1 device what 8 devices wrote).
    """
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            if x.sharding is not None:
                return x
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def average_params(param_trees: list) -> Any:
    """Element-wise mean of several parameter trees (computed in float32)."""
    if not param_trees:
        raise ValueError("average_params needs at least one parameter tree")
    return jax.tree.map(
        lambda *xs: (sum(np.asarray(x, np.float32) for x in xs) / len(xs)).astype(xs[0].dtype),
        *param_trees,
    )


def average_checkpoints(workdir, output_workdir, last_n: int, params_like) -> int:
    """Averages the params of the last `last_n` checkpoints of `workdir`.

    The result is saved as a params-only checkpoint at the latest step in
    `output_workdir` (which must not hold checkpoints yet), with the config.

    Returns:
      The step of the averaged checkpoint.
    """
    source = Checkpointer(workdir, read_only=True, async_save=False)
    steps = source.all_steps()
    if len(steps) < last_n:
        raise ValueError(
            f"{workdir} has {len(steps)} checkpoints {steps}; asked to average {last_n}")
    steps = steps[-last_n:]
    logging.info("averaging steps %s of %s", steps, workdir)
    trees = [jax.device_get(source.restore_params(s, params_like)) for s in steps]
    config = source.restore_config(steps[-1])
    config["averaged_steps"] = steps
    target_dir = checkpoint_dir(output_workdir)
    if target_dir.exists() and any(target_dir.iterdir()):
        raise ValueError(f"{target_dir} already holds checkpoints; choose an empty output workdir")
    target = Checkpointer(output_workdir, async_save=False)
    target.save_params(steps[-1], average_params(trees), config)
    target.wait()
    return steps[-1]


def write_json(path: str | Path, payload: Mapping) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")

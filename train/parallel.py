"""Devices: mesh, logical axis rules, shardings, the three step variants, multi-host.

One mesh with named axes ``(data, fsdp, tensor)`` is built from
``config.parallel.mesh_shape``; the models' logical axis names (models/axes.py)
are mapped onto it by ``config.parallel.logical_axis_rules``. The default rules
(configs/common.py) cover every strategy, so a preset is just a mesh shape
(see ``PRESETS``):

    dp      (-1, 1, 1)   batch split, everything else replicated
    fsdp    (1, -1, 1)   batch split, parameters + Adam moments split on 'embed' (ZeRO-3)
    tp      (1, 1, -1)   heads / kv_heads / mlp / vocab split (Megatron)
    dp_tp   (2, 1, -1)   both

Step variants (``config.parallel.step``):
  jit        jax.jit with explicit in/out shardings; GSPMD inserts the collectives.
  shard_map  data parallel: per-device loss and grads, explicit psum of grads and metrics.
  pmap       the same step under jax.pmap (for pmap-era code; each process feeds
             [local devices, rows/local devices, ...]; psums span all processes).

Dropout: jit variants draw the same masks on every mesh as on one device
(partitionable threefry draws by global position). shard_map/pmap fold the
device index into the key, so shards never share masks; their numbers equal the
jit variants only with dropout off, which is how the equivalence tests run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from transformer_zoo.models import axes
from transformer_zoo.models.variants import Kernels
from transformer_zoo.train.state import TrainState

log = logging.getLogger("train")

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # mesh axes the batch is split over
STEPS = ("jit", "shard_map", "pmap")

PRESETS = {
    "dp": (-1, 1, 1),
    "fsdp": (1, -1, 1),
    "tp": (1, 1, -1),
    "dp_tp": (2, 1, -1),
    "fsdp_tp": (1, 2, -1),
}

Rules = tuple[tuple[str, Any], ...]


# ---------------------------------------------------------------- mesh and rules


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces one -1 by the devices left over.

    Raises:
      ValueError: wrong length, several -1, a size < 1, or a product that is not
        the device count.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"parallel.mesh_shape={shape} needs one size per mesh axis {MESH_AXES}")
    if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise ValueError(f"parallel.mesh_shape={shape}: sizes must be >= 1, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"parallel.mesh_shape={shape}: {num_devices} devices are not "
                             f"divisible by the fixed sizes' product {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"parallel.mesh_shape={shape} multiplies to {math.prod(shape)}, "
                         f"but there are {num_devices} devices")
    return shape


def kernels_for(devices) -> Kernels:
    """Kernels.CPU when every device is a CPU, else Kernels.PORTABLE."""
    devices = list(devices)
    on_cpu = bool(devices) and all(d.platform == "cpu" for d in devices)
    return Kernels.CPU if on_cpu else Kernels.PORTABLE


def make_mesh(shape: Sequence[int], devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all, every process)."""
    devices = list(jax.devices() if devices is None else devices)
    resolved = resolve_mesh_shape(shape, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagation, not Explicit
    return jax.make_mesh(resolved, MESH_AXES, axis_types=auto, devices=devices)


def validate_rules(rules: Sequence[Sequence[Any]]) -> Rules:
    """Rules as a tuple of (logical name, mesh axis | tuple of axes | None).

    Raises:
      ValueError: a rule that is not a pair, or names an unknown logical or mesh axis.
    """
    out = []
    for rule in rules:
        if len(rule) != 2:
            raise ValueError(f"parallel.logical_axis_rules: {rule!r} is not a (logical, mesh) pair")
        logical, mesh_axes = rule[0], rule[1]
        if logical not in axes.ALL:
            raise ValueError(f"parallel.logical_axis_rules: unknown logical axis {logical!r}; "
                             f"known: {axes.ALL}")
        names = () if mesh_axes is None else (
            (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes))
        for name in names:
            if name not in MESH_AXES:
                raise ValueError(f"parallel.logical_axis_rules: rule {logical!r} -> {mesh_axes!r} "
                                 f"names unknown mesh axis {name!r}; mesh axes are {MESH_AXES}")
        out.append((logical, None if not names else names[0] if len(names) == 1 else names))
    return tuple(out)


# ---------------------------------------------------------------- shardings


def logical_to_mesh_spec(names: Sequence[str | None], shape: Sequence[int], mesh,
                         rules: Rules, what: str = "array") -> PartitionSpec:
    """Mesh PartitionSpec of an array with logical dim `names`.

    A logical name repeated in one array (e.g. the pooler's [embed, embed]) is
    sharded on its first occurrence only. A dim not divisible by its mesh axes'
    size is replicated (with a warning): jax refuses uneven shards of inputs.
    """
    seen, deduped = set(), []
    for n in names:
        deduped.append(None if n in seen else n)
        seen.add(n)
    spec = list(nn.logical_to_mesh_axes(deduped, rules))
    spec += [None] * (len(shape) - len(spec))
    for i, (dim, entry) in enumerate(zip(shape, spec, strict=True)):
        size = _axes_size(mesh, entry)
        if size > 1 and dim % size:
            log.warning("%s dim %d (size %d, %r) is not divisible by mesh %r (%d): replicated",
                        what, i, dim, names[i], entry, size)
            spec[i] = None
    return PartitionSpec(*spec)


def _axes_size(mesh, entry) -> int:
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[n] for n in names)


def param_shardings(boxed_params, mesh, rules: Rules):
    """NamedShardings of the unboxed params from the boxed (abstract) init."""
    specs = nn.get_partition_spec(boxed_params)
    shapes = nn.meta.unbox(boxed_params)
    paths = {id(leaf): jax.tree_util.keystr(p) for p, leaf in
             jax.tree_util.tree_flatten_with_path(shapes)[0]}

    def one(spec, leaf):
        spec = logical_to_mesh_spec(tuple(spec), leaf.shape, mesh, rules, paths[id(leaf)])
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(abstract_state: TrainState, params_sh, mesh) -> TrainState:
    """Shardings of a whole TrainState: Adam moments follow their params, scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        abstract_state.tx, lambda _, sh: sh, abstract_state.opt_state, params_sh,
        transform_non_params=lambda _: replicated)
    return abstract_state.replace(step=replicated, params=params_sh, opt_state=opt_sh,
                                  rng=replicated)


def batch_sharding(mesh, ndim: int, rows: int | None = None) -> NamedSharding:
    """Rows split over the batch axes (replicated if `rows` does not divide evenly)."""
    size = _axes_size(mesh, BATCH_AXES)
    if rows is not None and rows % size:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def global_batch(mesh, local_batch: dict) -> dict:
    """Global jax.Arrays from this process's rows (its data shard).

    The global batch is the processes' local batches stacked in process order
    (train/input.py gives each process data.batch_size / process_count rows).
    """
    procs = jax.process_count()

    def one(x):
        x = np.asarray(x)
        rows = x.shape[0] * procs
        if procs > 1 and rows % _axes_size(mesh, BATCH_AXES):
            # Replicating rows that differ per process would be wrong, not slow.
            raise ValueError(f"a global batch of {rows} rows ({x.shape[0]} per process) does "
                             f"not split over the {_axes_size(mesh, BATCH_AXES)} data-parallel "
                             "devices; make data.batch_size/eval_batch_size a multiple of it")
        sharding = batch_sharding(mesh, x.ndim, rows)
        if procs == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x)

    return {k: one(v) for k, v in local_batch.items()}


# ---------------------------------------------------------------- multi-host


def initialize_distributed(parallel_cfg) -> bool:
    """jax.distributed.initialize from config or the environment; True if it ran.

    Reads `coordinator_address`, `num_processes`, `process_id` from the config,
    falling back to JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
    with `distributed=True` and none of them, JAX detects the cluster (SLURM, TPU,
    ...). Must run before anything touches the devices.
    """
    env = os.environ
    address = parallel_cfg.get("coordinator_address") or env.get("JAX_COORDINATOR_ADDRESS")
    if not (address or parallel_cfg.get("distributed")):
        return False
    if jax.distributed.is_initialized():
        return True
    num = parallel_cfg.get("num_processes") or int(env.get("JAX_NUM_PROCESSES", 0)) or None
    pid = parallel_cfg.get("process_id", -1)
    pid = pid if pid >= 0 else (int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None)
    jax.distributed.initialize(coordinator_address=address or None, num_processes=num,
                               process_id=pid)
    if jax.process_index() != 0:  # only process 0 logs (MetricWriter also writes only there)
        log.setLevel(logging.WARNING)
    log.info("jax.distributed: process %d of %d, %d devices (%d local)", jax.process_index(),
             jax.process_count(), jax.device_count(), jax.local_device_count())
    return True


# ---------------------------------------------------------------- the plan of a run


@dataclasses.dataclass
class Plan:
    """How a run uses the devices: mesh, rules and step variant.

    Attributes:
      mesh: the (data, fsdp, tensor) mesh.
      rules: logical -> mesh axis rules.
      step: "jit" | "shard_map" | "pmap".
    """

    mesh: jax.sharding.Mesh
    rules: Rules
    step: str = "jit"

    @classmethod
    def from_config(cls, parallel_cfg, devices=None) -> Plan:
        """The Plan of `config.parallel` (ValueError on a bad mesh, rule or step)."""
        step = parallel_cfg.get("step", "jit")
        if step not in STEPS:
            raise ValueError(f"parallel.step={step!r} is unknown; choose from {STEPS}")
        rules = validate_rules(parallel_cfg.logical_axis_rules)
        plan = cls(make_mesh(parallel_cfg.mesh_shape, devices), rules, step)
        if step != "jit" and (plan.mesh.shape["fsdp"] > 1 or plan.mesh.shape["tensor"] > 1):
            raise ValueError(f"parallel.step={step!r} is data parallel only; got mesh "
                             f"{dict(plan.mesh.shape)} (use mesh_shape=(-1, 1, 1) or step='jit')")
        return plan

    @property
    def kernels(self) -> Kernels:
        """The models' kernels for this mesh: the XLA:CPU layer when its devices are CPUs."""
        return kernels_for(self.mesh.devices.flat)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shardings(self, model, task, abstract_state: TrainState) -> TrainState:
        """State shardings from the logical specs of the boxed params (task: a
        train.tasks.Task, or its family name)."""
        from transformer_zoo.train.tasks import get_task

        batch = get_task(task).dummy_batch()
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), **batch))
        params_sh = param_shardings(boxed["params"], self.mesh, self.rules)
        if self.step != "jit":  # data parallel: every device holds the whole state
            params_sh = jax.tree.map(lambda _: self.replicated, params_sh)
        return state_shardings(abstract_state, params_sh, self.mesh)

    def batch(self, local_batch: dict) -> Any:
        """This process's numpy batch -> step input (global arrays; [n, B/n, ...] for pmap)."""
        if self.step == "pmap":
            n = jax.local_device_count()
            return {k: np.reshape(v, (n, -1, *np.shape(v)[1:])) for k, v in local_batch.items()}
        return global_batch(self.mesh, local_batch)

    def place_state(self, state: TrainState) -> TrainState:
        """The state as the step wants it (replicated per device for pmap)."""
        if self.step != "pmap":
            return state
        n = jax.local_device_count()  # pmap splits a leading axis of this size
        stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), state)
        # Through pmap once, so step inputs carry pmap's own output sharding
        # (numpy inputs would make the second step compile again).
        return jax.pmap(lambda s: s, axis_name=PMAP_AXIS)(stacked)

    def global_state(self, state: TrainState, like: TrainState) -> TrainState:
        """Inverse of place_state: arrays laid out like `like` (for eval / checkpoints)."""
        if self.step != "pmap":
            return state
        return jax.tree.map(_unreplicate, state, like)

    def jit_train_step(self, step_fn: Callable, state_sh: TrainState) -> Callable:
        """`step_fn` (from make_train_step(axis_name=self.axis_name)) compiled for this plan.

        Returns:
          step(state, batch) -> (state, metrics) taking `self.batch(...)` output;
          for jit/shard_map it also has .lower(state, batch) (abstract inputs work).
        """
        if self.step == "pmap":
            return _pmap_step(step_fn)
        if self.step == "shard_map":
            step_fn = _shard_map_step(step_fn, self.mesh)

        def build(batch):
            batch_sh = {k: batch_sharding(self.mesh, len(v.shape)) for k, v in batch.items()}
            jitted = jax.jit(step_fn, in_shardings=(state_sh, batch_sh),
                             out_shardings=(state_sh, self.replicated), donate_argnums=0)
            # Inside shard_map the mesh axes are manual: no activation constraints there.
            return _in_scope(jitted, self.mesh, self.rules if self.step == "jit" else ())

        return _per_batch_structure(build)

    def jit_eval_step(self, eval_fn: Callable) -> Callable:
        """eval(params, local numpy batch) -> replicated metric sums, on the mesh."""
        jitted = _in_scope(jax.jit(eval_fn, out_shardings=self.replicated), self.mesh,
                           self.rules)
        return lambda params, batch: jitted(params, global_batch(self.mesh, batch))

    @property
    def axis_name(self) -> Any:
        """The axis name make_train_step reduces over (None: jit, GSPMD reduces)."""
        return {"jit": None, "shard_map": MESH_AXES, "pmap": PMAP_AXIS}[self.step]


PMAP_AXIS = "devices"


def _unreplicate(x: jax.Array, ref: jax.Array) -> jax.Array:
    """One replica of a pmap output (equal on every device) laid out like `ref`.

    From host memory, so it also works across processes, where `ref`'s sharding
    spans devices this process cannot address.
    """
    host = np.asarray(x.addressable_data(0)).reshape(ref.shape)
    return jax.make_array_from_callback(ref.shape, ref.sharding, lambda index: host[index])


def _pmap_step(step_fn: Callable) -> Callable:
    pmapped = jax.pmap(step_fn, axis_name=PMAP_AXIS, donate_argnums=0)

    def step(state, batch):
        new_state, metrics = pmapped(state, batch)
        return new_state, jax.tree.map(lambda x: x[0], metrics)  # psum'd: equal on all devices

    return step


def _shard_map_step(step_fn: Callable, mesh) -> Callable:
    """Data parallel with explicit collectives: step_fn psums grads over all mesh axes.

    check_vma=False keeps the classic semantics (grads of replicated params are
    per-device until the explicit psum) instead of JAX inserting the reduction.
    """
    rows = PartitionSpec(MESH_AXES)
    return jax.shard_map(step_fn, mesh=mesh, in_specs=(PartitionSpec(), rows),
                         out_specs=(PartitionSpec(), PartitionSpec()), check_vma=False)


def _per_batch_structure(build: Callable) -> Callable:
    """A step built on first sight of each batch structure (keys and ranks)."""
    cache = {}

    def key(batch):
        return tuple(sorted((k, len(v.shape)) for k, v in batch.items()))

    def call(state, batch):
        fn = cache.get(key(batch)) or cache.setdefault(key(batch), build(batch))
        return fn(state, batch)

    def lower(state, batch):
        return build(batch).lower(state, batch)

    call.lower = lower
    return call


def _in_scope(jitted, mesh, rules):
    """Calls (and traces) `jitted` with the mesh and the logical rules in scope.

    With the rules in scope, the models' nn.with_logical_constraint calls pin
    the activations' layouts (batch on data/fsdp, heads and FFN hidden on
    tensor) instead of leaving them all to GSPMD's propagation. Keeps .lower.
    """

    def call(*args):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return jitted(*args)

    def lower(*args):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return jitted.lower(*args)

    call.lower = lower
    return call

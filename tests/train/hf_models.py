"""Tiny Hugging Face checkpoints built locally (no download) for the conversion tests.

Each builder makes a randomly initialised `transformers` model from a small
config, saves it with `save_pretrained` into a folder, and for GPT-2 and
Marian adds a tokenizer trained on a few sentences.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import sentencepiece as spm
import torch
import transformers

EN = ("the small frog sat on a big stone", "Tom asked his teacher for advice",
      "a man is playing a guitar in the park", "the children ran to the old school",
      "she reads a book every evening", "two dogs are running through the snow")
DE = ("der kleine Frosch saß auf einem großen Stein", "Tom bat seinen Lehrer um Rat",
      "ein Mann spielt im Park Gitarre", "die Kinder liefen zur alten Schule",
      "sie liest jeden Abend ein Buch", "zwei Hunde laufen durch den Schnee")


def _save(model, folder: Path) -> Path:
    model.eval().save_pretrained(folder)
    return folder


def bert(folder: Path, head: str = "BertForMaskedLM", seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, num_labels=3, **overrides)
    return _save(getattr(transformers, head)(config), folder)


def gpt2_tokenizer(folder: Path) -> int:
    """A byte-level BPE (vocab.json + merges.txt) with <|endoftext|>; returns its size."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(EN + DE) * 5, vocab_size=320, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_model(os.fspath(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
         "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return tok.get_vocab_size()


def gpt2(folder: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    vocab = gpt2_tokenizer(folder) if with_tokenizer else 99
    eos = 0 if with_tokenizer else vocab - 1  # <|endoftext|> is the BPE's first id
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=eos, eos_token_id=eos)
    return _save(transformers.GPT2LMHeadModel(config), folder)


def _spm(texts, prefix: Path) -> spm.SentencePieceProcessor:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts) * 10), model_prefix=os.fspath(prefix), vocab_size=60,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def marian_tokenizer(folder: Path) -> dict[str, int]:
    """source.spm, target.spm and vocab.json in OPUS-MT's layout; returns the vocab."""
    folder.mkdir(parents=True, exist_ok=True)
    source, target = _spm(EN, folder / "src"), _spm(DE, folder / "tgt")
    os.replace(folder / "src.model", folder / "source.spm")
    os.replace(folder / "tgt.model", folder / "target.spm")
    vocab = {"</s>": 0, "<unk>": 1}  # then the pieces of both models, <pad> last
    for sp in (source, target):
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return vocab


def marian(folder: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    vocab = len(marian_tokenizer(folder)) if with_tokenizer else 99
    torch.manual_seed(seed)
    config = transformers.MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab, d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
        activation_function="swish", scale_embedding=True, pad_token_id=vocab - 1,
        decoder_start_token_id=vocab - 1, eos_token_id=0, forced_eos_token_id=None,
        bad_words_ids=[[vocab - 1]], init_std=0.3)  # as OPUS-MT's: never generate <pad>
    model = transformers.MarianMTModel(config)
    with torch.no_grad():  # a non-zero final_logits_bias, so the test sees it
        model.final_logits_bias.normal_(0.0, 0.1)
    return _save(model, folder)

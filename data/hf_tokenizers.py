"""Tokenizers of published Hugging Face checkpoints behind our ``Tokenizer`` interface.

``load_hf_tokenizer(folder)`` reads a checkpoint folder as downloaded from the Hub
and returns a tokenizer whose ids are the checkpoint's own:

* ``HFTokenizer``: a ``tokenizers.Tokenizer`` from ``tokenizer.json``, or assembled
  from ``vocab.txt`` (BERT WordPiece) or ``vocab.json`` + ``merges.txt`` (GPT-2
  byte-level BPE) the way ``transformers`` assembles it;
* ``MarianTokenizer``: an OPUS-MT folder (``source.spm``, ``target.spm``,
  ``vocab.json``), as ``transformers.MarianTokenizer`` tokenises it;
* ``SentencePieceTokenizer``: a lone sentencepiece model (T5's ``spiece.model``).

``encode`` gives the ids ``transformers`` gives (``add_special_tokens=True``)
without a trailing eos, because our pipeline and predict code append ``eos_id``
themselves; ``decode`` gives what ``transformers``' ``decode(...,
skip_special_tokens=True)`` gives for the ids before the first eos.

Special ids (``pad_id``, ``eos_id``, ``bos_id``, ``unk_id``) come from the folder's
tokenizer_config.json / special_tokens_map.json, then config.json, then the usual
token names; BERT's eos is [SEP] and its bos [CLS]; without a pad token pad = eos
(GPT-2's convention), without a bos token bos = pad (T5's and Marian's decoder
start), without an unk token unk = eos (GPT-2's unk is its eos token).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from typing import Any

import sentencepiece as spm
import tokenizers
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordPiece

from transformer_zoo.data.tokenizers import (
    _CONFIG_FILE,
    SentencePieceTokenizer,
    Tokenizer,
    _content_ids,
    _write_config,
    load_tokenizer,
    special_ids,
)

HF_TOKENIZER_FILE = "hf_tokenizer.json"  # Ours is tokenizer.json, so HF's is renamed.
_SPIECE_UNDERLINE = "\u2581"
# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (new ids are given in it).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
# Where each role's token is looked up, in order: tokenizer config keys, the
# model config's id key, then the usual names.
_ROLE_KEYS = {"pad": ("pad_token",), "eos": ("eos_token", "sep_token"),
              "bos": ("bos_token", "cls_token"), "unk": ("unk_token",)}
_ROLE_ID_KEYS = {"pad": "pad_token_id", "eos": "eos_token_id", "bos": "bos_token_id"}
_ROLE_NAMES = {"pad": ("[PAD]", "<pad>"), "eos": ("[SEP]", "</s>", "<|endoftext|>", "<eos>"),
               "bos": ("[CLS]", "<s>", "<|endoftext|>", "<bos>"),
               "unk": ("[UNK]", "<unk>", "<|endoftext|>")}
# Class defaults of transformers' BertTokenizer / GPT2Tokenizer, for folders
# whose tokenizer_config.json does not name the tokens.
_BERT_DEFAULTS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                  "cls_token": "[CLS]", "mask_token": "[MASK]"}
_GPT2_DEFAULTS = {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                  "eos_token": "<|endoftext|>"}
_LOOKED_FOR = ("source.spm + target.spm + vocab.json (Marian)", "tokenizer.json", "vocab.txt",
               "vocab.json + merges.txt", "spiece.model or one *.model")


# ---------------------------------------------------------------------------
# Files.


def _read_json(path: str) -> Any:
    """Parsed JSON of ``path``; ValueError naming it if it is not valid JSON."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from None


def _optional_json(path: str) -> dict:
    return _read_json(path) if os.path.isfile(path) else {}


def _folder_config(folder: str) -> dict:
    """tokenizer_config.json overlaid by special_tokens_map.json, as transformers reads them."""
    config = _optional_json(os.path.join(folder, "tokenizer_config.json"))
    config.update(_optional_json(os.path.join(folder, "special_tokens_map.json")))
    return config


def _token_str(value: Any) -> str | None:
    """A token as tokenizer configs store it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _is_our_config(path: str) -> bool:
    try:
        config = _read_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "type" in config and "model" not in config


def _write_our_config(directory: str | os.PathLike, config: dict) -> None:
    """Writes our tokenizer.json, refusing to overwrite a Hugging Face one."""
    path = os.path.join(directory, _CONFIG_FILE)
    if os.path.exists(path) and not _is_our_config(path):
        raise ValueError(f"{path} is a Hugging Face tokenizer file; save to another directory "
                         "(our config file has the same name)")
    _write_config(directory, config)


def _copy(source: str, directory: str | os.PathLike, name: str) -> None:
    target = os.path.join(directory, name)
    if os.path.abspath(target) != os.path.abspath(source):
        shutil.copyfile(source, target)


def _cut(ids: Iterable[int], eos_id: int, skip: Iterable[int]) -> list[int]:
    """Ids up to the first eos, without ``skip`` ids, after dropping leading ``skip`` ids.

    The leading ones go first because a sequence may start with a bos that is
    also the eos (GPT-2's <|endoftext|>).
    """
    ids, skip = [int(i) for i in ids], frozenset(skip)
    start = 0
    while start < len(ids) and ids[start] in skip:
        start += 1
    return _content_ids(ids[start:], eos_id, skip)


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation, contractions)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                     (" 're", "'re")):
        text = text.replace(old, new)
    return text


# ---------------------------------------------------------------------------
# HFTokenizer.


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with named special tokens (see the module docstring).

    Args:
      tokenizer: the backend; its truncation and padding are switched off, as
        transformers does when a call asks for neither.
      eos_token: end of sequence (BERT: [SEP]); required.
      pad_token: padding; default ``eos_token``.
      bos_token: start of sequence (BERT: [CLS]); default ``pad_token``.
      unk_token: unknown input; default ``eos_token``.
      clean_up_tokenization_spaces: apply transformers' clean-up to decoded text
        (as it does, never for a BPE model).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str,
                 pad_token: str | None = None, bos_token: str | None = None,
                 unk_token: str | None = None, clean_up_tokenization_spaces: bool = False):
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        pad_token = pad_token or eos_token
        self._tokens = {"pad": pad_token, "eos": eos_token, "bos": bos_token or pad_token,
                        "unk": unk_token or eos_token}
        self._ids = {}
        for role, token in self._tokens.items():
            self._ids[role] = tokenizer.token_to_id(token)
            if self._ids[role] is None:
                raise ValueError(f"HFTokenizer: {role} token {token!r} is not in the vocabulary")
        is_bpe = isinstance(tokenizer.model, BPE)
        self._clean_up = bool(clean_up_tokenization_spaces) and not is_bpe
        self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> HFTokenizer:
        """Reads tokenizer.json, vocab.txt or vocab.json + merges.txt from ``folder``.

        Raises:
          FileNotFoundError: none of those files is there.
          ValueError: a file is not valid JSON / not a tokenizer, or no eos token.
        """
        folder = os.fspath(folder)
        tok, config = _backend_and_config(folder)
        _add_config_tokens(tok, config)
        _apply_bos_eos_flags(tok, config)
        model_config = _optional_json(os.path.join(folder, "config.json"))
        roles = {role: _find_token(role, config, model_config, tok) for role in _ROLE_KEYS}
        if roles["eos"] is None:
            raise ValueError(f"{folder}: no end-of-sequence token found (looked for "
                             f"eos_token/sep_token in its configs and {_ROLE_NAMES['eos']})")
        return cls(tok, eos_token=roles["eos"], pad_token=roles["pad"],
                   bos_token=roles["bos"], unk_token=roles["unk"],
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces")))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Largest id + 1 (added tokens included)."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def unk_id(self) -> int:
        return self._ids["unk"]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str) -> list[int]:
        """transformers' ids for ``text``, minus the eos its post-processor appended."""
        encoding = self._tok.encode(text, add_special_tokens=True)
        ids = encoding.ids
        # sequence_ids is None for the post-processor's tokens, 0 for the text's
        # own (a literal "[SEP]" in the text stays).
        if ids and ids[-1] == self.eos_id and encoding.sequence_ids[-1] is None:
            ids = ids[:-1]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids before the first eos (leading pad/bos skipped), specials dropped."""
        content = _cut(ids, self.eos_id, (self.pad_id, self.bos_id))
        content = [i for i in content if 0 <= i < self._vocab_size]
        text = self._tok.decode(content, skip_special_tokens=True)
        return _clean_up_tokenization(text) if self._clean_up else text

    def save(self, directory: str | os.PathLike) -> None:
        """Writes hf_tokenizer.json and our tokenizer.json (tokens and ids) to ``directory``."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, HF_TOKENIZER_FILE))
        _write_our_config(directory, {
            "type": "hf", "tokenizer_file": HF_TOKENIZER_FILE,
            **{f"{role}_token": token for role, token in self._tokens.items()},
            "clean_up_tokenization_spaces": self._clean_up, "special_ids": special_ids(self)})

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Writes the files `transformers.AutoTokenizer.from_pretrained` reads.

        tokenizer.json (the backend, post-processor included, so the ids are
        the same) and tokenizer_config.json naming the special tokens.
        """
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": self._clean_up,
                  **{f"{role}_token": token for role, token in self._tokens.items()}}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=1)


def _backend_and_config(folder: str) -> tuple[tokenizers.Tokenizer, dict]:
    """The backend tokenizer from the folder's files, and its tokenizer config."""
    config = _folder_config(folder)
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        return _tokenizer_json(path), config
    vocab_txt = os.path.join(folder, "vocab.txt")
    if os.path.isfile(vocab_txt):
        config = {**_BERT_DEFAULTS, **config}
        return _wordpiece(vocab_txt, config), config
    vocab_json, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if os.path.isfile(vocab_json) and os.path.isfile(merges):
        config = {**_GPT2_DEFAULTS, **config}
        return _byte_level_bpe(vocab_json, merges, config), config
    raise FileNotFoundError(f"{folder}: no tokenizer.json, vocab.txt or vocab.json + merges.txt")


def _tokenizer_json(path: str) -> tokenizers.Tokenizer:
    _read_json(path)  # A clear error for a truncated download; tokenizers' names no file.
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception.
        raise ValueError(f"{path} is not a tokenizers file: {e}") from None


def _wordpiece(vocab_path: str, config: Mapping) -> tokenizers.Tokenizer:
    """BERT's WordPiece pipeline, as transformers' BertTokenizer assembles it."""
    unk, cls_token, sep = (_token_str(config.get(k)) for k in ("unk_token", "cls_token",
                                                                "sep_token"))
    tok = tokenizers.Tokenizer(WordPiece.from_file(vocab_path, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=config.get("tokenize_chinese_chars", True),
        strip_accents=config.get("strip_accents"), lowercase=config.get("do_lower_case", True))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    cls_id, sep_id = tok.token_to_id(cls_token), tok.token_to_id(sep)
    if cls_id is None or sep_id is None:
        raise ValueError(f"{vocab_path}: cls token {cls_token!r} or sep token {sep!r} missing")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls_token}:0 $A:0 {sep}:0",
        pair=f"{cls_token}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls_token, cls_id), (sep, sep_id)])
    return tok


def _byte_level_bpe(vocab_path: str, merges_path: str, config: Mapping) -> tokenizers.Tokenizer:
    """GPT-2's byte-level BPE pipeline, as transformers' GPT2Tokenizer assembles it."""
    _read_json(vocab_path)
    model = BPE.from_file(vocab_path, merges_path, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False, dropout=None)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(config.get("add_prefix_space", False)))
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_config_tokens(tok: tokenizers.Tokenizer, config: Mapping) -> None:
    """Adds the config's added and special tokens the backend lacks, as transformers does.

    They are matched whole in text and dropped by ``skip_special_tokens``; a token
    missing from the vocabulary gets the next free id.
    """
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    added = [AddedToken(d["content"], single_word=d.get("single_word", False),
                        lstrip=d.get("lstrip", False), rstrip=d.get("rstrip", False),
                        normalized=d.get("normalized", True), special=d.get("special", False))
             for _, d in sorted(config.get("added_tokens_decoder", {}).items(),
                                key=lambda item: int(item[0]))]
    names = [_token_str(config.get(k)) for k in _SPECIAL_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        names += [_token_str(t) for t in (extra if isinstance(extra, list) else [])]
    added += [AddedToken(name, special=True) for name in names if name]
    new, seen = [], set(present)
    for token in added:
        if token.content not in seen:
            new.append(token)
            seen.add(token.content)
    if new:
        tok.add_tokens(new)


def _apply_bos_eos_flags(tok: tokenizers.Tokenizer, config: Mapping) -> None:
    """An explicit add_bos_token / add_eos_token rebuilds the post-processor (transformers)."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None

    def template(type_id: int, name: str) -> str:
        parts = [f"{bos}:{type_id}"] if add_bos else []
        parts.append(f"${name}:{type_id}")
        return " ".join(parts + ([f"{eos}:{type_id}"] if add_eos else []))

    specials = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(
        single=template(0, "A"), pair=f"{template(0, 'A')} {template(1, 'B')}",
        special_tokens=list(dict(specials).items()))


def _find_token(role: str, config: Mapping, model_config: Mapping,
                tok: tokenizers.Tokenizer) -> str | None:
    """The token playing ``role`` (pad/eos/bos/unk), or None (see the module docstring)."""
    for key in _ROLE_KEYS[role]:
        token = _token_str(config.get(key))
        if token is not None and tok.token_to_id(token) is not None:
            return token
    token_id = model_config.get(_ROLE_ID_KEYS.get(role, ""))
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        token = tok.id_to_token(token_id)
        if token is not None:
            return token
    return next((t for t in _ROLE_NAMES[role] if tok.token_to_id(t) is not None), None)


# ---------------------------------------------------------------------------
# MarianTokenizer.


class MarianTokenizer:
    """An OPUS-MT tokenizer: two sentencepiece models and one shared vocab.json.

    ``encode`` (source side) and ``encode_target`` tokenise as transformers'
    MarianTokenizer does without and with ``text_target``: the text is split at
    special tokens; a leading language code (">>de<<") is kept whole; the rest
    is cut into pieces by the side's sentencepiece model (no other
    normalisation; transformers sets up a Moses normaliser but never calls it);
    pieces map to ids through vocab.json, unknown pieces to unk. ``decode``
    turns the ids before the first eos (pad, unk and other specials dropped)
    into pieces and joins them with the target model. bos = pad: Marian's
    ``decoder_start_token_id`` is its pad id.

    Args:
      source_spm, target_spm: the sentencepiece model files.
      vocab: vocab.json (piece -> id).
      eos_token, unk_token, pad_token: names of the special pieces in ``vocab``.
      additional_special_tokens: other pieces treated as special.
    """

    SOURCE_SPM, TARGET_SPM, VOCAB = "source.spm", "target.spm", "vocab.json"

    def __init__(self, source_spm: str | os.PathLike, target_spm: str | os.PathLike,
                 vocab: str | os.PathLike, *, eos_token: str = "</s>", unk_token: str = "<unk>",
                 pad_token: str = "<pad>", additional_special_tokens: Iterable[str] = ()):
        self._files = {"source_spm": os.fspath(source_spm), "target_spm": os.fspath(target_spm),
                       "vocab": os.fspath(vocab)}
        self._source = spm.SentencePieceProcessor(model_file=self._files["source_spm"])
        self._target = spm.SentencePieceProcessor(model_file=self._files["target_spm"])
        self._encoder = _read_json(self._files["vocab"])
        if not isinstance(self._encoder, dict):
            raise ValueError(f"{self._files['vocab']}: expected a piece -> id object")
        self._decoder = {int(i): piece for piece, i in self._encoder.items()}
        self._tokens = {"eos": eos_token, "unk": unk_token, "pad": pad_token}
        self._specials = [eos_token, unk_token, pad_token, *additional_special_tokens]
        missing = [t for t in self._specials if t not in self._encoder]
        if missing:
            raise ValueError(f"{self._files['vocab']}: special tokens {missing} not in vocab")
        self._special_ids = frozenset(self._encoder[t] for t in self._specials)
        # Longest first, like transformers' trie of added tokens.
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(set(self._specials), key=len, reverse=True)) + ")")
        self._vocab_size = max(self._decoder) + 1

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> MarianTokenizer:
        """Reads an OPUS-MT folder (source.spm, target.spm, vocab.json, token configs)."""
        folder = os.fspath(folder)
        paths = [os.path.join(folder, name) for name in (cls.SOURCE_SPM, cls.TARGET_SPM,
                                                          cls.VOCAB)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{folder}: Marian tokenizer files missing: {missing}")
        config = _folder_config(folder)
        if config.get("separate_vocabs"):
            raise ValueError(f"{folder}: Marian models with separate vocabularies "
                             "(target_vocab.json) are not supported")
        extra = [_token_str(t) for t in config.get("additional_special_tokens") or []]
        return cls(*paths, eos_token=_token_str(config.get("eos_token")) or "</s>",
                   unk_token=_token_str(config.get("unk_token")) or "<unk>",
                   pad_token=_token_str(config.get("pad_token")) or "<pad>",
                   additional_special_tokens=[t for t in extra if t])

    @property
    def vocab_size(self) -> int:
        """Largest vocab.json id + 1."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._encoder[self._tokens["pad"]]

    @property
    def eos_id(self) -> int:
        return self._encoder[self._tokens["eos"]]

    @property
    def bos_id(self) -> int:
        """The pad id: Marian starts decoding from it."""
        return self.pad_id

    @property
    def unk_id(self) -> int:
        return self._encoder[self._tokens["unk"]]

    def token_to_id(self, token: str) -> int | None:
        return self._encoder.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._decoder.get(int(token_id))

    def encode(self, text: str) -> list[int]:
        """Source-side ids (transformers' ``tokenizer(text)`` without the eos)."""
        return self._encode(text, self._source)

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids (transformers' ``tokenizer(text_target=text)`` without the eos)."""
        return self._encode(text, self._target)

    def _encode(self, text: str, sp: spm.SentencePieceProcessor) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self._specials:
                ids.append(self._encoder[part])
            elif part:
                ids.extend(self._encoder.get(p, self.unk_id) for p in _marian_pieces(part, sp))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Target text of the ids before the first eos; pad/unk/specials dropped."""
        content = _content_ids(ids, self.eos_id, self._special_ids)
        pieces = [self._decoder[i] for i in content if i in self._decoder]
        return self._target.decode_pieces(pieces).replace(_SPIECE_UNDERLINE, " ").strip()

    def save(self, directory: str | os.PathLike) -> None:
        """Copies the spm models and vocab.json and writes our tokenizer.json."""
        os.makedirs(directory, exist_ok=True)
        names = {"source_spm": self.SOURCE_SPM, "target_spm": self.TARGET_SPM,
                 "vocab": self.VOCAB}
        for key, name in names.items():
            _copy(self._files[key], directory, name)
        _write_our_config(directory, {
            "type": "marian", **names,
            **{f"{role}_token": token for role, token in self._tokens.items()},
            "additional_special_tokens": self._specials[3:], "special_ids": special_ids(self)})

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Writes the files `transformers.MarianTokenizer.from_pretrained` reads."""
        os.makedirs(directory, exist_ok=True)
        for key, name in (("source_spm", self.SOURCE_SPM), ("target_spm", self.TARGET_SPM),
                          ("vocab", self.VOCAB)):
            _copy(self._files[key], directory, name)
        config = {"tokenizer_class": "MarianTokenizer",
                  **{f"{role}_token": token for role, token in self._tokens.items()}}
        if self._specials[3:]:
            config["additional_special_tokens"] = self._specials[3:]
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=1)


def _marian_pieces(text: str, sp: spm.SentencePieceProcessor) -> list[str]:
    """transformers' MarianTokenizer._tokenize: a leading ">>xx<<" code, then spm pieces."""
    code = []
    if text.startswith(">>") and (end := text.find("<<")) != -1:
        code, text = [text[:end + 2]], text[end + 2:]
    return code + sp.encode(text, out_type=str)


# ---------------------------------------------------------------------------
# Entry points.


def load_hf_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint folder (see the module docstring).

    A folder written by our own ``save`` (its tokenizer.json is our config) is read
    with ``load_tokenizer``; otherwise this looks, in order, for source.spm (Marian),
    tokenizer.json, vocab.txt, vocab.json + merges.txt, then spiece.model or a
    single ``*.model``.

    Raises:
      FileNotFoundError: ``folder`` does not exist or has none of those files.
      ValueError: a file is not valid JSON, several ``*.model`` files, no eos token.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"tokenizer folder {folder!r} does not exist")
    config_path = os.path.join(folder, _CONFIG_FILE)
    if os.path.isfile(config_path) and _is_our_config(config_path):
        return load_tokenizer(folder)
    if os.path.isfile(os.path.join(folder, MarianTokenizer.SOURCE_SPM)):
        return MarianTokenizer.from_folder(folder)
    names = set(os.listdir(folder))
    if names & {"tokenizer.json", "vocab.txt"} or {"vocab.json", "merges.txt"} <= names:
        return HFTokenizer.from_folder(folder)
    model = _sentencepiece_model(folder, names)
    if model is not None:
        return SentencePieceTokenizer(model)
    raise FileNotFoundError(f"no tokenizer files in {folder!r}; looked for: "
                            + "; ".join(_LOOKED_FOR))


def _sentencepiece_model(folder: str, names: set[str]) -> str | None:
    if "spiece.model" in names:
        return os.path.join(folder, "spiece.model")
    models = sorted(n for n in names if n.endswith(".model"))
    if len(models) > 1:
        raise ValueError(f"{folder}: several sentencepiece models {models}; expected one")
    return os.path.join(folder, models[0]) if models else None


def from_config(directory: str | os.PathLike, config: Mapping) -> HFTokenizer | MarianTokenizer:
    """Restores what ``HFTokenizer.save`` / ``MarianTokenizer.save`` wrote (load_tokenizer)."""
    tokens = {key: config[key] for key in ("eos_token", "pad_token", "unk_token")}
    if config["type"] == "marian":
        files = [os.path.join(directory, config[k]) for k in ("source_spm", "target_spm",
                                                               "vocab")]
        return MarianTokenizer(*files, **tokens,
                               additional_special_tokens=config["additional_special_tokens"])
    tok = _tokenizer_json(os.path.join(directory, config["tokenizer_file"]))
    return HFTokenizer(tok, **tokens, bos_token=config["bos_token"],
                       clean_up_tokenization_spaces=config["clean_up_tokenization_spaces"])

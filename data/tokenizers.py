"""Tokenizers: our own (one fixed set of special ids) and the shared interface.

Our own tokenizers (char, word/char, and the sentencepiece models that
``train_sentencepiece`` writes) use the ids defined here and nowhere else:

====== == ==========================================================
PAD_ID 0  padding; model masks treat id 0 as "no token"
EOS_ID 1  end of sequence; the pipeline appends it to every sequence
BOS_ID 2  start of sequence; the decoder's shift-right inserts it
UNK_ID 3  out-of-vocabulary piece
====== == ==========================================================

Tokenizers of published checkpoints keep their own ids (BERT's [SEP] is 102,
GPT-2's <|endoftext|> 50256, a sentencepiece model may have no pad piece), so every
tokenizer reports its ids as the properties ``pad_id``, ``eos_id``, ``bos_id`` and
``unk_id``; code that appends or looks for a special id asks the tokenizer.

Tokenizers never emit their pad/eos/bos ids from ``encode``; ``decode`` stops at
the first eos id and skips pad/bos ids, so it accepts model outputs directly.

Every tokenizer saves itself to a directory (``tokenizer.json`` plus model files)
and ``load_tokenizer(directory)`` restores whichever kind was saved there.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import shutil
import tempfile
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import sentencepiece as spm

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
NUM_SPECIAL = 4
SPECIAL_PIECES = ("<pad>", "</s>", "<s>", "<unk>")
_UNK_TEXT = "\u2047"  # "⁇", what sentencepiece prints for <unk> too.
_CONFIG_FILE = "tokenizer.json"

log = logging.getLogger(__name__)


def normalize_text(text: str) -> str:
    """Returns ``text`` in the normal form all loaders and tokenizers agree on.

    Unicode NFC; every run of Unicode whitespace (tab, newline, U+00A0 no-break
    space, ...) becomes one ASCII space; leading/trailing whitespace removed.
    Multi30k's German side has U+00A0 and a tab that would otherwise become
    distinct tokens.
    """
    return " ".join(unicodedata.normalize("NFC", text).split())


@runtime_checkable
class Tokenizer(Protocol):
    """What the pipeline, training and decoding need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included (ids are in [0, vocab_size))."""
        ...

    @property
    def pad_id(self) -> int:
        """Padding id (PAD_ID for our tokenizers)."""
        ...

    @property
    def eos_id(self) -> int:
        """End of sequence: the pipeline appends it to every sequence (EOS_ID for ours)."""
        ...

    @property
    def bos_id(self) -> int:
        """Start of sequence / decoder start id (BOS_ID for ours; may equal pad_id)."""
        ...

    @property
    def unk_id(self) -> int:
        """Id of out-of-vocabulary input (UNK_ID for ours)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without eos (the pipeline appends ``eos_id``)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; stops at ``eos_id``, skips ``pad_id`` and ``bos_id``."""
        ...

    def save(self, directory: str | os.PathLike) -> None:
        """Writes the tokenizer to ``directory`` (created if missing)."""
        ...


class _FixedSpecialIds:
    """The special-id properties of our own tokenizers: the module constants."""

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def unk_id(self) -> int:
        return UNK_ID


def _content_ids(
    ids: Iterable[int], eos_id: int = EOS_ID, skip: Iterable[int] = (PAD_ID, BOS_ID)
) -> list[int]:
    """The ids before the first ``eos_id``, without those in ``skip``."""
    skip = frozenset(skip)
    out = []
    for i in ids:
        i = int(i)
        if i == eos_id:
            break
        if i not in skip:
            out.append(i)
    return out


def _write_config(directory: str | os.PathLike, config: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)


def _spm_special_ids(sp: spm.SentencePieceProcessor) -> tuple[int, int, int, int, int]:
    """(pad, eos, bos, unk, vocab_size) of a sentencepiece model, missing ids filled in.

    A model without a pad piece (sentencepiece's default) gets pad = the first id
    past the pieces; one without eos the next one: the model's embedding needs a
    row for them. Without bos, bos = pad, T5's decoder-start convention.
    """
    next_id = sp.get_piece_size()
    pad = sp.pad_id()
    if pad < 0:
        pad, next_id = next_id, next_id + 1
    eos = sp.eos_id()
    if eos < 0:
        eos, next_id = next_id, next_id + 1
    bos = sp.bos_id() if sp.bos_id() >= 0 else pad
    return pad, eos, bos, sp.unk_id(), next_id


class SentencePieceTokenizer:
    """A sentencepiece model (BPE or unigram) with whatever special ids it has.

    Ids come from the model (see ``_spm_special_ids`` for the ones it lacks);
    ``train_sentencepiece`` writes models with our fixed ids.
    """

    MODEL_FILE = "spm.model"

    def __init__(self, model_path: str | os.PathLike):
        self._model_path = os.fspath(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=self._model_path)
        self._num_pieces = self._sp.get_piece_size()
        (self._pad_id, self._eos_id, self._bos_id, self._unk_id,
         self._vocab_size) = _spm_special_ids(self._sp)

    @property
    def vocab_size(self) -> int:
        """Pieces plus the pad/eos ids added past them (if the model lacks them)."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def unk_id(self) -> int:
        return self._unk_id

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(normalize_text(text), out_type=int)

    def model_proto(self) -> bytes:
        """The serialized sentencepiece model (its pieces, scores and settings)."""
        return self._sp.serialized_model_proto()

    def decode(self, ids: Iterable[int]) -> str:
        content = _content_ids(ids, self._eos_id, (self._pad_id, self._bos_id))
        # Ids past the pieces (an added pad/eos, or a model's padded vocabulary)
        # have no text; sentencepiece would raise on them.
        return self._sp.decode([i for i in content if 0 <= i < self._num_pieces])

    def save(self, directory: str | os.PathLike) -> None:
        target = os.path.join(directory, self.MODEL_FILE)
        os.makedirs(directory, exist_ok=True)
        if os.path.abspath(target) != os.path.abspath(self._model_path):
            shutil.copyfile(self._model_path, target)
        _write_config(directory, {"type": "sentencepiece", "model_file": self.MODEL_FILE,
                                  "special_ids": special_ids(self)})


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """``{"pad": ..., "eos": ..., "bos": ..., "unk": ...}`` of ``tokenizer``."""
    return {name: getattr(tokenizer, f"{name}_id") for name in ("pad", "eos", "bos", "unk")}


def check_special_ids(tokenizer: Tokenizer, config: dict, path: str) -> Tokenizer:
    """Returns ``tokenizer`` if its special ids are those ``config`` recorded.

    Raises:
      ValueError: they differ (the files next to ``path`` were replaced).
    """
    saved = config.get("special_ids")
    if saved is not None and saved != special_ids(tokenizer):
        raise ValueError(f"{path}: saved special ids {saved} but the tokenizer files give "
                         f"{special_ids(tokenizer)}")
    return tokenizer


class SpmModelType(enum.StrEnum):
    """The sentencepiece algorithms `train_sentencepiece` trains."""

    BPE = "bpe"  # byte-pair merges (Sennrich et al. 2016); BPE-dropout needs it
    UNIGRAM = "unigram"  # unigram language model (Kudo 2018)


def train_sentencepiece(
    texts: Iterable[str],
    directory: str | os.PathLike,
    *,
    vocab_size: int,
    model_type: SpmModelType | str = SpmModelType.BPE,
    character_coverage: float = 1.0,
    byte_fallback: bool = False,
    max_sentences: int = 1_000_000,
) -> SentencePieceTokenizer:
    """Trains a sentencepiece model on ``texts`` or reuses the one in ``directory``.

    For a joint source+target vocabulary pass both sides' texts (see
    ``sources.sample_texts``). Only the first ``max_sentences`` texts are consumed,
    streamed: pass an already-sampled iterable for a uniform sample of a big corpus.

    Args:
      texts: training sentences (normalised here with ``normalize_text``).
      directory: where ``spm.model`` and ``tokenizer.json`` are written; if a model
        is already there it is loaded instead of retrained (and checked).
      vocab_size: requested vocabulary size including the 4 specials; tiny corpora
        may yield fewer pieces (``hard_vocab_limit=False``).
      model_type: a `SpmModelType` (or its value).
      character_coverage: fraction of characters covered by the vocabulary.
      byte_fallback: encode uncovered characters as UTF-8 byte pieces instead of UNK.
      max_sentences: upper bound on the sentences read (bounded memory).

    Returns:
      The trained (or reused) tokenizer.
    """
    # As models.variants.parse does; data does not import models (and flax).
    if model_type not in SpmModelType._value2member_map_:
        raise ValueError(f"model_type={model_type!r} is unknown; choose from "
                         f"{[kind.value for kind in SpmModelType]}")
    model_type = SpmModelType(model_type)
    if vocab_size <= NUM_SPECIAL:
        raise ValueError(f"vocab_size must be > {NUM_SPECIAL}, got {vocab_size}")
    model_path = os.path.join(directory, SentencePieceTokenizer.MODEL_FILE)
    if os.path.exists(model_path):
        log.info("Reusing sentencepiece model %s", model_path)
        return _with_fixed_ids(SentencePieceTokenizer(model_path), model_path)
    os.makedirs(directory, exist_ok=True)
    # Train into a temp dir and move: a crash mid-training never leaves a
    # half-written model that a later run would silently reuse.
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        prefix = os.path.join(tmp, "spm")
        spm.SentencePieceTrainer.train(
            sentence_iterator=_bounded_normalized(texts, max_sentences),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type=model_type.value,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
            pad_piece=SPECIAL_PIECES[0], eos_piece=SPECIAL_PIECES[1],
            bos_piece=SPECIAL_PIECES[2], unk_piece=SPECIAL_PIECES[3],
            # Our normalize_text already did NFC + whitespace; a second NFKC pass
            # would break the decode(encode(x)) == normalize_text(x) contract.
            normalization_rule_name="identity",
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        os.replace(prefix + ".model", model_path)
    tokenizer = SentencePieceTokenizer(model_path)
    tokenizer.save(directory)
    return tokenizer


def _with_fixed_ids(tokenizer: SentencePieceTokenizer, path: str) -> SentencePieceTokenizer:
    """Checks that a reused model has the fixed ids ``train_sentencepiece`` promises."""
    got = tuple(special_ids(tokenizer).values())
    if got != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
        raise ValueError(f"sentencepiece model {path} has (pad, eos, bos, unk) ids {got}, "
                         f"expected {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}")
    return tokenizer


def _bounded_normalized(texts: Iterable[str], limit: int) -> Iterable[str]:
    for n, text in enumerate(texts):
        if n >= limit:
            return
        text = normalize_text(text)
        if text:
            yield text


class CharTokenizer(_FixedSpecialIds):
    """One id per character; ids start after the specials (NUM_SPECIAL).

    No normalisation: a char LM must see newlines and runs of spaces. Characters
    outside the vocabulary encode to UNK_ID and decode to "⁇".
    """

    def __init__(self, chars: Sequence[str]):
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError(f"chars must be distinct single characters, got {list(chars)!r}")
        self._chars = list(chars)
        self._ids = {c: i + NUM_SPECIAL for i, c in enumerate(self._chars)}

    @classmethod
    def build(cls, texts: Iterable[str]) -> CharTokenizer:
        """Vocabulary = the sorted set of characters in ``texts``."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls(sorted(chars))

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self._chars)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, UNK_ID) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self._piece(i) for i in _content_ids(ids))

    def _piece(self, i: int) -> str:
        return self._chars[i - NUM_SPECIAL] if NUM_SPECIAL <= i < self.vocab_size else _UNK_TEXT

    def save(self, directory: str | os.PathLike) -> None:
        _write_config(directory, {"type": "char", "chars": self._chars})


class WordCharTokenizer(_FixedSpecialIds):
    """A fixed vocabulary of whole words plus single characters.

    ``encode`` splits normalised text on spaces; a piece found in ``words`` is one
    id, any other piece is spelled character by character (each must be in
    ``chars`` or it becomes UNK_ID). ``decode`` joins words with spaces and glues
    consecutive characters together, so the round trip holds for text where no
    two spelled pieces are adjacent, e.g. the number task: "1204" (source, char
    level) and "one thousand two hundred four" (target, word level).
    """

    def __init__(self, words: Sequence[str], chars: Sequence[str] = ()):
        pieces = list(words) + list(chars)
        if len(set(pieces)) != len(pieces):
            raise ValueError(f"words and chars must be distinct, got {pieces!r}")
        if any(len(c) != 1 for c in chars):
            raise ValueError(f"chars must be single characters, got {list(chars)!r}")
        if any(not w or w != normalize_text(w) or " " in w for w in words):
            raise ValueError(f"words must be non-empty without whitespace, got {list(words)!r}")
        self._words, self._chars = list(words), list(chars)
        self._pieces = pieces
        self._ids = {p: i + NUM_SPECIAL for i, p in enumerate(pieces)}
        self._is_char = [False] * len(words) + [True] * len(chars)

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self._pieces)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in normalize_text(text).split(" "):
            if piece in self._ids and not self._is_char[self._ids[piece] - NUM_SPECIAL]:
                ids.append(self._ids[piece])
            else:
                ids.extend(self._ids.get(c, UNK_ID) for c in piece)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        prev_char = False
        for i in _content_ids(ids):
            k = i - NUM_SPECIAL
            is_char = 0 <= k < len(self._pieces) and self._is_char[k]
            piece = self._pieces[k] if 0 <= k < len(self._pieces) else _UNK_TEXT
            if out and not (is_char and prev_char):
                out.append(" ")
            out.append(piece)
            prev_char = is_char
        return "".join(out)

    def save(self, directory: str | os.PathLike) -> None:
        _write_config(directory, {"type": "word_char", "words": self._words, "chars": self._chars})


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Restores the tokenizer that ``save(directory)`` wrote.

    Raises:
      FileNotFoundError: ``directory`` has no tokenizer.json.
      ValueError: tokenizer.json is truncated or not a tokenizer's (names the
        file and how to recover), the saved type is unknown, or the special ids
        recorded there differ from those of the restored tokenizer.
    """
    path = os.path.join(directory, _CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer saved in {os.fspath(directory)!r} ({path} missing)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        return _from_config(directory, config, path)
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError, UnicodeDecodeError
        if isinstance(err, ValueError) and str(err).startswith(path):
            raise  # already names the file (unknown type, special ids)
        what = f"missing field {err}" if isinstance(err, KeyError) else str(err)
        raise ValueError(
            f"{path} is truncated or not a saved tokenizer ({what}); delete "
            f"{os.fspath(directory)} to rebuild it from the data, or restore it from a "
            "backup") from err


def _from_config(directory, config: dict, path: str) -> Tokenizer:
    """The tokenizer that tokenizer.json's `config` describes."""
    kind = config.get("type")
    if kind == "sentencepiece":
        tokenizer = SentencePieceTokenizer(os.path.join(directory, config["model_file"]))
        return check_special_ids(tokenizer, config, path)
    if kind in ("hf", "marian"):
        # Lazy: hf_tokenizers imports this module.
        from transformer_zoo.data import hf_tokenizers

        return check_special_ids(hf_tokenizers.from_config(directory, config), config, path)
    if kind == "char":
        return CharTokenizer(config["chars"])
    if kind == "word_char":
        return WordCharTokenizer(config["words"], config["chars"])
    raise ValueError(f"{path}: unknown tokenizer type {kind!r}")

"""BPE-dropout (Provilkov et al., 2020): a sentencepiece BPE model's merges, each
skipped at random, so training sees many segmentations of one word.

    sampler = BpeDropout(tokenizer, rate=0.1)       # a SentencePieceTokenizer (BPE)
    ids = sampler.encode(text, random.Random("0/17"))

At every merge step each applicable merge is dropped with probability `rate`; the
most frequent (highest-scoring) of the rest is applied, the leftmost on a tie; the
word stops when none is left. At rate 0 this is the model's own segmentation, id
for id (tests/data/test_bpe_dropout.py checks it against sentencepiece on Multi30k
and on text the model cannot cover). Held-out text is never sampled.

Why not sentencepiece's own `enable_sampling`: its random generator is one per
thread, seeded once, so a sample cannot be tied to (seed, example index), which
resuming a run bitwise needs (data/pipeline.py seeds each example by its index).
"""

from __future__ import annotations

import random
import re

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from transformer_zoo.data.tokenizers import SentencePieceTokenizer, normalize_text

_Piece = model_pb2.ModelProto.SentencePiece
_WORD_START = re.compile("(?=\u2581)")  # sentencepiece's space; each word starts with it


class BpeDropout:
    """Samples segmentations of text with a sentencepiece BPE model's merges.

    Raises (at construction):
      ValueError: `rate` outside [0, 1); a tokenizer that is not a sentencepiece
        BPE model, or a BPE model whose encoding this does not reproduce
        (whitespace as suffix, no split at whitespace, unused or user-defined
        pieces, extra whitespace kept).
    """

    def __init__(self, tokenizer: SentencePieceTokenizer, rate: float):
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise ValueError(f"BPE-dropout rate must be in [0, 1), got {rate!r}")
        if not isinstance(tokenizer, SentencePieceTokenizer):
            raise ValueError(f"BPE-dropout needs a sentencepiece BPE tokenizer, got "
                             f"{type(tokenizer).__name__}")
        serialized = tokenizer.model_proto()
        proto = model_pb2.ModelProto.FromString(serialized)
        _check_model(proto)
        self.rate = float(rate)
        self._unk_id = tokenizer.unk_id
        self._byte_fallback = proto.trainer_spec.byte_fallback
        self._ids = {p.piece: i for i, p in enumerate(proto.pieces)}
        # Merge priority: the piece's score (sentencepiece BPE: minus its merge rank).
        self._score = {p.piece: p.score for p in proto.pieces if p.type == _Piece.NORMAL}
        self._normalizer = spm.SentencePieceProcessor(model_proto=serialized)

    def encode(self, text: str, rng: random.Random) -> list[int]:
        """The ids of one sampled segmentation of `text` (no EOS), drawn from `rng`."""
        normalized = self._normalizer.normalize(normalize_text(text))
        ids: list[int] = []
        for word in _WORD_START.split(normalized):
            if word:
                for piece in self._segment(word, rng):
                    self._append(ids, piece)
        return ids

    def _segment(self, word: str, rng: random.Random) -> list[str]:
        symbols = list(word)
        lookup, rate, draw = self._score.get, self.rate, rng.random  # hot loop: locals
        while len(symbols) > 1:
            best, at = None, -1
            for i in range(len(symbols) - 1):
                score = lookup(symbols[i] + symbols[i + 1])
                if score is None or (rate and draw() < rate):
                    continue
                if best is None or score > best:  # strict: the leftmost wins a tie
                    best, at = score, i
            if best is None:
                break
            symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
        return symbols

    def _append(self, ids: list[int], piece: str) -> None:
        if piece in self._score:
            ids.append(self._ids[piece])
        elif self._byte_fallback:
            ids.extend(self._ids[f"<0x{b:02X}>"] for b in piece.encode("utf-8"))
        elif not ids or ids[-1] != self._unk_id:
            # sentencepiece merges a run of unknown characters into one unknown id.
            ids.append(self._unk_id)


def _check_model(proto) -> None:
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != model_pb2.TrainerSpec.BPE:
        kind = model_pb2.TrainerSpec.ModelType.Name(trainer.model_type).lower()
        raise ValueError(f"BPE-dropout needs a sentencepiece BPE model, got model type {kind!r}")
    unsupported = {
        "treat_whitespace_as_suffix=True": trainer.treat_whitespace_as_suffix,
        "split_by_whitespace=False": not trainer.split_by_whitespace,
        "unused pieces": any(p.type == _Piece.UNUSED for p in proto.pieces),
        "user-defined pieces": any(p.type == _Piece.USER_DEFINED for p in proto.pieces),
        "remove_extra_whitespaces=False": not normalizer.remove_extra_whitespaces,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ValueError(f"BPE-dropout does not reproduce this sentencepiece BPE model's "
                         f"encoding: it has {', '.join(found)}")

"""The target side's pieces of a joint vocabulary: a smaller output layer (data.output_vocab).

A joint source + target sentencepiece vocabulary holds pieces that only one
language uses: of Multi30k's 8000 joint BPE pieces, 5473 occur in the German
training targets. The decoder can be trained and decode with its softmax over
those alone (``ModelConfig.output_ids``): the output layer and the loss, a
large share of a small model's step, shrink with them, and the model never
spends probability on a piece its targets cannot hold.

Every target must then be spelt with pieces of the set. Training targets are
by construction; a held-out (or BPE-dropout) target may contain a piece the
training targets never used (13 of val's 15527 German tokens). ``restrict``
spells each such piece with the longest pieces of the set that make up its
text, left to right (the vocabulary-threshold fallback of subword-nmt's
``apply_bpe``, Sennrich et al. 2016). The set also holds the single-character
piece of every character of the training targets and of the word start, so
the text decoded from the spelt ids is the same; a character the targets never
use becomes the unknown id.

    vocab = TargetVocabulary.build(tokenizer, train_target_texts)
    model_config = ModelConfig(..., output_ids=vocab.ids)
    ids = vocab.restrict(tokenizer.encode(held_out_target))
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

from sentencepiece import sentencepiece_model_pb2 as model_pb2

from transformer_zoo.data.tokenizers import SentencePieceTokenizer, normalize_text

_NORMAL = model_pb2.ModelProto.SentencePiece.NORMAL
_WORD_START = "\u2581"  # sentencepiece's space: "▁"


class OutputVocab(enum.StrEnum):
    """Which pieces the decoder's output layer scores."""

    ALL = "all"  # every piece of the (joint) vocabulary
    TARGET_SIDE = "target_side"  # the pieces of the training targets (+ their characters)


@dataclasses.dataclass(frozen=True)
class TargetVocabulary:
    """The ids of a target side's pieces, and how any other piece is spelt with them.

    Attributes:
      ids: the allowed ids, ascending (EOS and UNK always among them).
      fallback: {id outside `ids`: its spelling with ids of `ids`} for every
        piece of the model outside the set (ids past the model's pieces, an
        added pad or EOS, are never encoded and have none).
    """

    ids: tuple[int, ...]
    fallback: dict[int, tuple[int, ...]]

    @classmethod
    def build(cls, tokenizer: SentencePieceTokenizer,
              target_texts: Iterable[str]) -> TargetVocabulary:
        """The pieces `tokenizer` uses to encode `target_texts` (the training targets), and
        the single-character pieces of their characters and of the word start, so that
        any text of those characters can be spelt without UNK.

        Raises:
          ValueError: `tokenizer` is not a sentencepiece model, or the texts are empty.
        """
        if not isinstance(tokenizer, SentencePieceTokenizer):
            raise ValueError("data.output_vocab='target_side' needs a sentencepiece tokenizer, "
                             f"got {type(tokenizer).__name__}")
        used: set[int] = set()
        chars: set[str] = {_WORD_START}
        for text in target_texts:
            used.update(tokenizer.encode(text))
            chars.update(normalize_text(text).replace(" ", _WORD_START))
        if len(used) == 0:
            raise ValueError("data.output_vocab='target_side': the training targets hold no "
                             "token, so there is no target side to keep")
        return cls.from_ids(tokenizer, used, chars)

    @classmethod
    def from_ids(cls, tokenizer: SentencePieceTokenizer, ids: Iterable[int],
                 pieces: Iterable[str] = ()) -> TargetVocabulary:
        """The vocabulary of `ids`, the normal pieces among `pieces` (texts), EOS and UNK,
        with the spelling of every other piece."""
        proto_pieces = model_pb2.ModelProto.FromString(tokenizer.model_proto()).pieces
        normal = {p.piece: i for i, p in enumerate(proto_pieces) if p.type == _NORMAL}
        allowed = frozenset({*ids, tokenizer.eos_id, tokenizer.unk_id,
                             *(normal[p] for p in pieces if p in normal)})
        if min(allowed) < 0 or max(allowed) >= tokenizer.vocab_size:
            raise ValueError(f"output ids must lie in [0, {tokenizer.vocab_size}), got "
                             f"{min(allowed)}..{max(allowed)}")
        kept = {piece: i for piece, i in normal.items() if i in allowed}
        # A byte piece ('<0xE2>', byte fallback) has no text to spell: UNK, like any
        # other piece outside the set that is not a normal one.
        fallback = {i: _spell(p.piece, kept, tokenizer.unk_id) if p.type == _NORMAL
                    else (tokenizer.unk_id,)
                    for i, p in enumerate(proto_pieces) if i not in allowed}
        return cls(tuple(sorted(allowed)), fallback)

    def restrict(self, ids: Sequence[int]) -> list[int]:
        """`ids` with every piece outside the set spelt with pieces of the set."""
        out: list[int] = []
        for i in ids:
            out.extend(self.fallback.get(i, (i,)))
        return out


def _spell(text: str, kept: dict[str, int], unk_id: int) -> tuple[int, ...]:
    """`text` as the longest kept pieces, left to right; a character none starts: UNK."""
    out, start = [], 0
    while start < len(text):
        end = next((e for e in range(len(text), start, -1) if text[start:e] in kept), None)
        out.append(unk_id if end is None else kept[text[start:end]])
        start = start + 1 if end is None else end
    return tuple(out)

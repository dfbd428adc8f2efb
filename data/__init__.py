"""Datasets -> token ids -> fixed-shape numpy batches. No jax transforms, no models.

Typical use (the embedded default task)::

    from transformer_zoo import data

    tokenizer = data.number_tokenizer()
    train = data.make_batches(
        data.number_words("train"),
        data.Batching(mode="pack", batch_size=64, max_inputs_length=8, max_targets_length=16),
        tokenizer=tokenizer, train=True, seed=0)
    it = iter(train)
    batch = next(it)           # dict of int32 arrays, see data.packing
    state = it.get_state()     # small JSON-able dict; store it in the checkpoint
    it2 = iter(train); it2.set_state(state)   # next(it2) == next(it)
"""

from transformer_zoo.data.bpe_dropout import BpeDropout
from transformer_zoo.data.hf_tokenizers import HFTokenizer, MarianTokenizer, load_hf_tokenizer
from transformer_zoo.data.output_vocab import OutputVocab, TargetVocabulary
from transformer_zoo.data.packing import pack, pad, unpack
from transformer_zoo.data.pipeline import Batching, BatchMode, lm_windows, make_batches, tokenize
from transformer_zoo.data.sources import (
    parallel_files,
    sample_texts,
    text_corpus,
    text_files,
    tfds_text,
    tfds_translation,
    tsv_file,
)
from transformer_zoo.data.synthetic import (
    MAX_NUMBER,
    number_split,
    number_to_words,
    number_tokenizer,
    number_words,
    sorted_classification,
    symbol_task,
    symbol_tokenizer,
)
from transformer_zoo.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    NUM_SPECIAL,
    PAD_ID,
    UNK_ID,
    CharTokenizer,
    SentencePieceTokenizer,
    SpmModelType,
    Tokenizer,
    WordCharTokenizer,
    load_tokenizer,
    normalize_text,
    train_sentencepiece,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MAX_NUMBER",
    "NUM_SPECIAL",
    "PAD_ID",
    "UNK_ID",
    "BatchMode",
    "Batching",
    "BpeDropout",
    "CharTokenizer",
    "HFTokenizer",
    "MarianTokenizer",
    "OutputVocab",
    "SentencePieceTokenizer",
    "SpmModelType",
    "TargetVocabulary",
    "Tokenizer",
    "WordCharTokenizer",
    "lm_windows",
    "load_hf_tokenizer",
    "load_tokenizer",
    "make_batches",
    "normalize_text",
    "number_split",
    "number_to_words",
    "number_tokenizer",
    "number_words",
    "pack",
    "pad",
    "parallel_files",
    "sample_texts",
    "sorted_classification",
    "symbol_task",
    "symbol_tokenizer",
    "text_corpus",
    "text_files",
    "tfds_text",
    "tfds_translation",
    "tokenize",
    "train_sentencepiece",
    "tsv_file",
    "unpack",
]

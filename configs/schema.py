"""The declared fields of the run config's `model`, `data`, `decode` and `train` sections.

Each field is declared once, with its default and one comment: `model` is generated
from models.ModelConfig (its fields, defaults and docstring), each data task has its
own table, and `decode` and `train` have one each. `section` turns a table into the
locked ml_collections.ConfigDict a recipe edits and `--config.<section>.<field>=...`
overrides (a None default becomes a typed placeholder, so it can be set from the
command line); `check` refuses unknown keys, naming the key, the section's fields
and the closest one, before a run does any work.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from transformer_zoo.data import BatchMode, OutputVocab, SpmModelType
from transformer_zoo.models import Kernels, ModelConfig
from transformer_zoo.train.checkpoint import BestMode
from transformer_zoo.train.schedules import Schedule
from transformer_zoo.train.scores import DecodeMetric
from transformer_zoo.train.state import Optimizer, check_weight_decay


@dataclasses.dataclass(frozen=True)
class Field:
    """One declared config field.

    Attributes:
      default: the value a recipe starts from (None: unset).
      doc: the field's one comment.
      kind: the type of a None default (what the command line may set it to).
      choices: the values allowed, if only some are.
      required: None is an error (a path or dataset name the task cannot guess).
      at_least: the smallest value allowed (None: no lower bound).
      above: values must be greater than this (None: no such bound).
      below: values must be less than this (None: no upper bound).
      at_most: the largest value allowed (None: no such bound).
    """

    default: Any
    doc: str
    kind: type | None = None
    choices: tuple = ()
    required: bool = False
    at_least: float | None = None
    above: float | None = None
    below: float | None = None
    at_most: float | None = None

    def check_choice(self, name: str, value) -> None:
        """ValueError naming `name` and `value` if a set value is not one of the choices."""
        if self.choices and value not in self.choices:
            raise ValueError(f"{name}={value!r} is unknown; choose from "
                             f"{[str(choice) for choice in self.choices]}")

    def check_range(self, name: str, value) -> None:
        """ValueError naming `name` and `value` if a set number is outside the range."""
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return
        bounds = (("at_least", ">=", lambda b: value >= b), ("above", ">", lambda b: value > b),
                  ("below", "<", lambda b: value < b), ("at_most", "<=", lambda b: value <= b))
        broken = [f"{op} {getattr(self, a)}" for a, op, ok in bounds
                  if getattr(self, a) is not None and not ok(getattr(self, a))]
        if broken:
            wanted = " and ".join(f"{op} {getattr(self, a)}" for a, op, _ in bounds
                                  if getattr(self, a) is not None)
            raise ValueError(f"{name} must be {wanted}, got {value!r}")


Fields = Mapping[str, Field]


def section(fields: Fields) -> ml_collections.ConfigDict:
    """The locked ConfigDict of `fields` at their defaults (None: a typed placeholder)."""
    values = {}
    for name, field in fields.items():
        if field.default is None and field.kind is None:
            raise TypeError(f"field {name!r} has a None default and no kind")
        values[name] = (config_dict.placeholder(field.kind) if field.default is None
                        else field.default)
    out = ml_collections.ConfigDict(values)
    out.lock()
    return out


def checked(values: Mapping, fields: Fields, where: str, owner: str | None = None) -> dict:
    """`values` over the defaults of `fields`, every key known and every value allowed.

    Args:
      values: a section of the run config (ConfigDict or dict).
      fields: its declared fields.
      where: the section's name in messages ("data", "decode", ...).
      owner: what declares the fields, in messages (default: the section).

    Raises:
      ValueError: a key that is not a field (with the fields and the closest
        one), a required field left None, or a value outside a field's choices
        or range.
    """
    for key in values:
        if key not in fields:
            raise unknown_key(key, fields, where, owner)
    out = {name: field.default for name, field in fields.items()} | dict(values)
    for name, field in fields.items():
        if field.required and out[name] is None:
            raise ValueError(f"{where}.{name} is required by {owner or where}; set it with "
                             f"--config.{where}.{name}=...")
        field.check_choice(f"{where}.{name}", out[name])
        field.check_range(f"{where}.{name}", out[name])
    return out


def unknown_key(key: str, fields: Fields, where: str, owner: str | None = None) -> ValueError:
    """The error of `where.key` not being one of `fields`, with a 'did you mean'."""
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"{where}.{key} is not a field of {owner or where}{hint} "
                      f"(its fields: {', '.join(sorted(fields))})")


# ---------------------------------------------------------------------------
# model: generated from models.ModelConfig.

# Fields the run chooses when the config leaves them None, and how.
CHOSEN_BY_THE_RUN = {
    "vocab_size": "None = the tokenizer's vocabulary size (a value set must equal it).",
    "kernels": "None = the devices' choice; a value set is honoured.",
    "pad_id": "None = the tokenizer's; a value set is honoured.",
    "bos_id": "None = the tokenizer's; a value set is honoured.",
    "eos_id": "None = the tokenizer's; a value set is honoured.",
}


def attribute_docs(cls) -> dict[str, str]:
    """name -> text of the Google-style `Attributes:` section of `cls`'s docstring."""
    text = inspect.cleandoc(cls.__doc__).split("Attributes:", 1)[1]
    docs, name = {}, None
    for line in text.splitlines():
        match = re.match(r"  (\w+): (.*)", line)
        if match:
            name, docs[match[1]] = match[1], match[2]
        elif name and line.startswith("    "):
            docs[name] += " " + line.strip()
        elif line.strip():
            break  # the next section
    return docs


def _config_value(default):
    """A ModelConfig default as the run config holds it: enums and dtypes as strings."""
    if isinstance(default, enum.Enum):
        return default.value
    if default is None or isinstance(default, bool | int | float | str):
        return default
    return jnp.dtype(default).name  # dtype and param_dtype


def _kind(hint) -> type:
    """The command-line type of a field annotated `hint` (int | None -> int, enums -> str)."""
    args = [a for a in typing.get_args(hint) if a is not types.NoneType] or [hint]
    kind = args[0]
    return str if isinstance(kind, type) and issubclass(kind, enum.Enum) else kind


# ModelConfig fields a run derives from its data, never set in the run config:
# output_ids are the pieces of the training targets (data.output_vocab chooses).
SET_BY_THE_DATA = frozenset({"output_ids"})


def model_fields() -> dict[str, Field]:
    """A Field per ModelConfig field (but SET_BY_THE_DATA): its default, its docstring
    line, its type."""
    docs, hints = attribute_docs(ModelConfig), typing.get_type_hints(ModelConfig)
    out = {}
    for f in dataclasses.fields(ModelConfig):
        if f.name in SET_BY_THE_DATA:
            continue
        doc, default = docs.get(f.name, ""), _config_value(f.default)
        if f.name in CHOSEN_BY_THE_RUN:
            doc, default = f"{doc} {CHOSEN_BY_THE_RUN[f.name]}", None
        out[f.name] = Field(default, doc, _kind(hints[f.name]))
    return out


MODEL_FIELDS = model_fields()


# Model fields that regularise or say how to compute, not what the model computes:
# a run may set them apart from the run whose params it starts from (init_from).
FINE_TUNABLE_MODEL_FIELDS = frozenset({
    "dropout_rate", "attention_dropout_rate", "activation_dropout_rate", "attention_impl",
    "dtype", "param_dtype", "kernels"})


def check_model(values: Mapping) -> dict:
    """ValueError on an unknown key or an invalid value of the `model` section.

    Builds the ModelConfig with a stand-in vocabulary (and default special ids)
    where they are left to the tokenizer, so a bad value fails before the
    tokenizer is built.
    """
    fields = checked(values, MODEL_FIELDS, "model", "models.ModelConfig")
    # A value set (0 included, so it is refused) is checked as set.
    stand_in = next((fields[k] for k in ("vocab_size", "input_vocab_size")
                     if fields[k] is not None), 1)
    left_to_the_run = {k: getattr(ModelConfig, k) for k in ("pad_id", "bos_id", "eos_id")
                       if fields[k] is None}
    ModelConfig(**{**fields, "vocab_size": stand_in, **left_to_the_run,
                   "kernels": fields["kernels"] or Kernels.PORTABLE})
    return fields


# ---------------------------------------------------------------------------
# data: one table per task (train/input.py builds each).

_BATCHES = {
    "batching": Field("pack", "pack: several examples per row (first fit) | bucket: one "
                      "example per row, padded to its length bucket", choices=tuple(BatchMode)),
    "batch_size": Field(64, "global rows (pack) or examples (bucket) per training batch; "
                        "None with tokens_per_batch", int, at_least=1),
    "tokens_per_batch": Field(None, "instead of batch_size: rows = tokens_per_batch // row "
                              "length", int, at_least=1),
    "max_inputs_length": Field(None, "longest inputs kept (with EOS); the packed row length",
                               int, at_least=1),
    "eval_batch_size": Field(None, "held-out examples per eval batch; None = batch_size", int,
                             at_least=1),
    "max_eval_examples": Field(None, "held-out examples for the eval loss (the first N); "
                               "None = all", int, at_least=1),
}
_TARGETS = {
    "max_targets_length": Field(None, "longest targets kept (with EOS); the packed row length",
                                int, at_least=1),
    "num_decode_examples": Field(0, "held-out examples decoded at the end for the metric",
                                 at_least=0),
}
_SENTENCEPIECE = {
    "vocab_size": Field(32000, "sentencepiece vocabulary to train (with the 4 special ids); "
                        "joint over source and target", at_least=5),
    "spm_model_type": Field("bpe", "sentencepiece model: bpe | unigram",
                            choices=tuple(SpmModelType)),
    "spm_character_coverage": Field(1.0, "share of characters the vocabulary covers",
                                    above=0.0, at_most=1.0),
    "spm_byte_fallback": Field(False, "uncovered characters as UTF-8 byte pieces, not UNK"),
    "spm_max_sentences": Field(1_000_000, "training examples sampled to train the tokenizer",
                               at_least=1),
    "bpe_dropout": Field(0.0, "BPE-dropout on training text (Provilkov et al. 2020): each "
                         "merge skipped with this probability; spm_model_type bpe only; "
                         "0 = off", at_least=0.0, below=1.0),
}
_OUTPUT_VOCAB = {
    "output_vocab": Field("all", "pieces the decoder's output layer scores: all (the joint "
                          "vocabulary) | target_side (those of the training targets: a "
                          "smaller output layer; encoder_decoder only)",
                          choices=tuple(OutputVocab)),
}
_SYNTHETIC = {
    "num_train_examples": Field(100_000, "examples per epoch (sampled)", at_least=1),
    "num_eval_examples": Field(1000, "held-out examples (disjoint from training)", at_least=1),
}
_TFDS = {
    "tfds_name": Field(None, "tfds dataset (with its config, e.g. 'wmt14_translate/de-en')",
                       str, required=True),
    "tfds_data_dir": Field(None, "tfds data directory; None = tfds' own", str),
    "train_split": Field("train", "tfds split to train on"),
}


def _task(name: str, *groups: Fields, **fields: Field) -> dict[str, Field]:
    return {"task": Field(name, "which data task (the table of its fields)"),
            **{k: v for group in groups for k, v in group.items()}, **fields}


DATA_TASKS: dict[str, dict[str, Field]] = {
    # data.number_words: digits -> English words, held-out numbers disjoint.
    "numbers": _task("numbers", _SYNTHETIC, _BATCHES, _TARGETS,
                     num_train_examples=Field(200_000, "examples per epoch (sampled)", at_least=1)),
    # data.sorted_classification: label 1 iff the letters are sorted (encoder_only).
    "sorted": _task("sorted", _SYNTHETIC, _BATCHES,
                    batching=dataclasses.replace(_BATCHES["batching"], default="bucket"),
                    num_symbols=Field(10, "letters in the alphabet", at_least=2)),
    # data.parallel_files: one sentence per line, source and target files aligned.
    "parallel_files": _task(
        "parallel_files", _SENTENCEPIECE, _OUTPUT_VOCAB, _BATCHES, _TARGETS,
        train_source=Field(None, "training source sentences, one per line", str, required=True),
        train_target=Field(None, "training target sentences, aligned", str, required=True),
        eval_source=Field(None, "held-out source (selection only)", str, required=True),
        eval_target=Field(None, "held-out target", str, required=True),
        test_source=Field(None, "test source, decoded once at the end; None/'' = none", str),
        test_target=Field(None, "test target", str)),
    # data.tfds_translation: a tfds translate dataset (ArrayRecord, no TensorFlow).
    "tfds_translation": _task(
        "tfds_translation", _TFDS, _SENTENCEPIECE, _OUTPUT_VOCAB, _BATCHES, _TARGETS,
        source_key=Field(None, "source language feature; None = the builder's first", str),
        target_key=Field(None, "target language feature; None = the builder's second", str),
        eval_split=Field("validation", "held-out split (selection only)"),
        test_split=Field(None, "split decoded once at the end; None/'' = none", str)),
    # data.text_corpus: one text file, characters as tokens, decoder_only.
    "text_file": _task(
        "text_file",
        path=Field(None, "the text file", str, required=True),
        train_fraction=Field(0.9, "leading share of the text for training; the rest is held out",
                             above=0.0, below=1.0),
        seq_length=Field(128, "context: characters per row", at_least=1),
        batch_size=Field(64, "global rows per batch", at_least=1),
        max_eval_batches=Field(None, "held-out batches per evaluation; None = all", int,
                               at_least=1),
        long_eval_length=Field(None, "also score the whole held-out text at the end in rows of "
                               "this many characters (e.g. 2 x seq_length: how RoPE/ALiBi "
                               "extrapolate); None = no", int, at_least=1)),
    # data.tfds_text: a tfds dataset of sentences, sentencepiece, decoder_only.
    "tfds_text": _task(
        "tfds_text", _TFDS, _SENTENCEPIECE,
        text_key=Field("text", "the text feature"),
        eval_split=Field("validation", "held-out split"),
        max_eval_examples=_BATCHES["max_eval_examples"],
        batching=_BATCHES["batching"],
        batch_size=Field(64, "global rows (pack) or sentences (bucket) per batch", at_least=1),
        seq_length=Field(128, "tokens per row (longer sentences are dropped)", at_least=1)),
}


def data_section(task: str) -> ml_collections.ConfigDict:
    """The locked `data` section of `task` at its defaults."""
    if task not in DATA_TASKS:
        raise ValueError(f"data.task={task!r} is unknown; choose from {sorted(DATA_TASKS)}")
    return section(DATA_TASKS[task])


def data_fields(values: Mapping) -> ml_collections.FrozenConfigDict:
    """Every field of the `data` section's task (defaults filled in), read by attribute.

    Raises:
      ValueError: an unknown task, a key that is not one of the task's fields,
        a required field unset or a value outside a field's choices.
    """
    task = dict(values).get("task")
    if task not in DATA_TASKS:
        raise ValueError(f"data.task={task!r} is unknown; choose from {sorted(DATA_TASKS)}")
    return ml_collections.FrozenConfigDict(
        checked(values, DATA_TASKS[task], "data", f"data task {task!r}"))


# ---------------------------------------------------------------------------
# decode and train.

DECODE_FIELDS = {
    "beam_size": Field(4, "the paper's beam; 1 = greedy", at_least=1),
    "alpha": Field(0.6, "GNMT length penalty ((5 + |Y|) / 6)^alpha", at_least=0.0),
    "max_extra": Field(50, "max output length = input length + max_extra", at_least=1),
    "batch_size": Field(64, "sentences per decoding batch", at_least=1),
    "num_print": Field(5, "decoded examples printed at the end", at_least=0),
    "eval_examples": Field(100, "held-out examples decoded at each periodic eval; 0 = at the "
                           "end only", at_least=0),
    "metric": Field("bleu", "bleu (sacreBLEU + chrF) | exact_match",
                    choices=tuple(DecodeMetric)),
    "sample_length": Field(0, "decoder_only: tokens sampled at the end after sample_prompt "
                           "(printed, and in WORKDIR/sample.txt); 0 = no sample", at_least=0),
    "sample_prompt": Field("\n", "decoder_only: the text the sample continues"),
    "sample_temperature": Field(0.8, "decoder_only: the sample's softmax temperature",
                                above=0.0),
}

TRAIN_FIELDS = {
    "num_steps": Field(100_000, "optimizer steps (micro-steps with accumulation)", at_least=1),
    "label_smoothing": Field(0.1, "the paper's epsilon_ls", at_least=0.0, below=1.0),
    "log_every": Field(100, "steps between console / metrics.jsonl lines", at_least=1),
    "eval_every": Field(1000, "steps between held-out evaluations; 0 = only at the end",
                        at_least=0),
    "checkpoint_every": Field(1000, "steps between checkpoints", at_least=1),
    "keep_checkpoints": Field(5, "the latest K are kept (the paper averaged 5 / 20)",
                              at_least=1),
    "best_metric": Field("loss", "eval metric whose best checkpoint is kept too; '' = off"),
    "best_mode": Field("min", "min | max: which is best", choices=tuple(BestMode)),
    # At the end: the params of the last N checkpoints are averaged (into
    # WORKDIR/averaged), the held-out set is decoded with both, the better is kept
    # (selection on held-out data only) and decodes data.test_* if the task has it.
    "average_last": Field(0, "checkpoints averaged at the end; 0/1 = off", at_least=0),
    # The tied output layer and the loss in pieces of the target length, so the
    # [B, T, V] logits and their gradient are never stored (train/chunked_loss.py).
    "loss_chunks": Field(0, "0 = the loss on the model's logits; n >= 1: in n pieces of the "
                         "target length (generating families, tie_output)", at_least=0),
}

# The `optim` section's choices and ranges (its fields and defaults are declared in
# configs/common.py); `check` refuses a value outside them.
OPTIM_FIELDS = {
    "name": Field("adam", "adam | adamw", choices=tuple(Optimizer)),
    "schedule": Field("rsqrt_warmup", "learning-rate schedule", choices=tuple(Schedule)),
    "b1": Field(0.9, "Adam beta1", at_least=0.0, below=1.0),
    "b2": Field(0.98, "Adam beta2", at_least=0.0, below=1.0),
    "eps": Field(1e-9, "Adam epsilon", above=0.0),
    "weight_decay": Field(0.0, "decoupled, adamw only (adam refuses > 0)", at_least=0.0),
    "learning_rate": Field(1.0, "peak lr (rsqrt_warmup: a multiplier)", above=0.0),
    "end_learning_rate": Field(0.0, "final lr of warmup_cosine", at_least=0.0),
    "warmup_steps": Field(4000, "linear warmup length", at_least=0),
    "clip_norm": Field(0.0, "global-norm clipping; 0 = off", at_least=0.0),
    "grad_accum_steps": Field(1, "micro-batches per update", at_least=1),
}


def _check_long_eval(length: int | None, model: Mapping) -> None:
    """A learned position table cannot score rows longer than itself."""
    if length and model["position_encoding"] == "learned" and length > model["max_length"]:
        raise ValueError(f"data.long_eval_length={length} is longer than the learned position "
                         f"table (model.max_length={model['max_length']}); raise max_length or "
                         "use position_encoding='rope' or 'alibi'")


def _check_schedule(optim: Mapping, num_steps: int) -> None:
    """A warmup the schedule needs, and a cosine decay that has steps to decay over."""
    schedule = optim.get("schedule", OPTIM_FIELDS["schedule"].default)
    warmup = optim.get("warmup_steps", OPTIM_FIELDS["warmup_steps"].default)
    if schedule != Schedule.CONSTANT and warmup < 1:
        raise ValueError(f"optim.warmup_steps={warmup} must be >= 1 for "
                         f"optim.schedule={str(schedule)!r}")
    if schedule == Schedule.WARMUP_COSINE and num_steps <= warmup:
        raise ValueError(f"optim.schedule='warmup_cosine' decays over train.num_steps="
                         f"{num_steps}, which must exceed optim.warmup_steps={warmup}")


def _check_loss_chunks(chunks: int, family: str | None, model: Mapping) -> None:
    """The chunked loss reads the tied table of a generating family's decoder."""
    if not chunks:
        return
    if family == "encoder_only":
        raise ValueError(f"train.loss_chunks={chunks} needs a generating family "
                         "(encoder_decoder or decoder_only), got family='encoder_only'")
    if not model["tie_output"]:
        raise ValueError(f"train.loss_chunks={chunks} needs model.tie_output=True (the "
                         "chunked loss reads the tied embedding table)")


def _check_output_vocab(choice: str | None, family: str | None) -> None:
    """The target side's pieces are the outputs of a decoder that reads a source."""
    if choice not in (None, OutputVocab.ALL) and family != "encoder_decoder":
        raise ValueError(f"data.output_vocab={choice!r} needs family='encoder_decoder' (the "
                         f"pieces of the targets, apart from the source's), got {family!r}")


def check(config) -> None:
    """ValueError on an unknown key or a bad value in model, data, decode or train.

    Called before a run does any work (no tokenizer, no data, nothing written).
    """
    model = check_model(config.model)
    _check_output_vocab(data_fields(config.data).get("output_vocab"), config.get("family"))
    _check_long_eval(config.data.get("long_eval_length"), model)
    checked(config.decode, DECODE_FIELDS, "decode")
    train = checked(config.train, TRAIN_FIELDS, "train")
    _check_loss_chunks(train["loss_chunks"], config.get("family"), model)
    optim = config.get("optim") or {}
    for name, field in OPTIM_FIELDS.items():
        if name in optim:
            field.check_choice(f"optim.{name}", optim[name])
            field.check_range(f"optim.{name}", optim[name])
    _check_schedule(optim, config.train.num_steps)
    check_weight_decay(optim.get("name", OPTIM_FIELDS["name"].default),
                       optim.get("weight_decay", OPTIM_FIELDS["weight_decay"].default))

"""Hugging Face folder <-> zoo (config, parameters, tokenizer) <-> workdir.

`read_hf(folder)` reads config.json, the weights and the tokenizer of a
Hugging Face folder into a `Converted` (family, ModelConfig, parameters,
tokenizer); `write_hf(converted, folder)` writes one back as config.json +
model.safetensors (+ tokenizer files) that `transformers` loads with
`from_pretrained`. `from_hf` / `to_hf` do the same between a folder and a
workdir that `load_run`, `train.decode` and `init_from` read. Every check runs
before anything is written, and output goes to a temporary directory that is
renamed into place only when complete, so an error leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
from flax.core import meta

from transformer_zoo.data import load_hf_tokenizer
from transformer_zoo.models import ModelConfig
from transformer_zoo.train.hf import bert, gpt2, marian
from transformer_zoo.train.hf.base import Architecture
from transformer_zoo.train.hf.rules import flatten, to_hf_tensors, to_zoo_params
from transformer_zoo.train.hf.weights import (
    SAFETENSORS,
    ConversionError,
    load_tensors,
    read_json,
    save_tensors,
    weight_files,
)
from transformer_zoo.train.tasks import get_task

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a for a in (bert.ARCHITECTURE, gpt2.ARCHITECTURE, marian.ARCHITECTURE)}
BY_FAMILY: dict[str, Architecture] = {a.family: a for a in ARCHITECTURES.values()}
# Files that mark a folder as holding a tokenizer (data.load_hf_tokenizer reads them).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "source.spm", "spiece.model")


@dataclasses.dataclass
class Converted:
    """A model in zoo terms.

    Attributes:
      family: "encoder_only", "decoder_only" or "encoder_decoder".
      config: its ModelConfig.
      params: its parameter tree (numpy float32 arrays).
      tokenizer: its tokenizer, or None when the folder had none.
      model_type: the Hugging Face architecture (bert, gpt2, marian).
    """

    family: str
    config: ModelConfig
    params: Any
    tokenizer: Any
    model_type: str


def _architecture(hf_config: dict, where: Path) -> Architecture:
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConversionError(f"{where}: model_type {model_type!r} is not supported; "
                              f"supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def zoo_shapes(family: str, cfg: ModelConfig) -> dict[str, tuple]:
    """The parameter shapes of the zoo model `cfg` describes, by "/" path (nothing allocated)."""
    task = get_task(family)
    model = task.build(cfg)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), **task.dummy_batch()))
    return {k: tuple(v.shape) for k, v in flatten(meta.unbox(abstract["params"])).items()}


def read_hf(folder: str | os.PathLike) -> Converted:
    """A Hugging Face folder (config.json, weights, optional tokenizer) in zoo terms.

    Raises:
      ConversionError: not a folder, config.json missing or invalid, an
        unsupported model_type or setting, missing or damaged weights, a
        tensor whose shape config.json does not imply, or tensors the
        conversion would drop; a tokenizer whose special ids disagree.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a directory")
    hf_config = read_json(folder / "config.json")
    arch = _architecture(hf_config, folder / "config.json")
    files = weight_files(folder)
    tensors = load_tensors(files)
    cfg = arch.config_from_hf(hf_config, set(tensors))
    tokenizer = _read_tokenizer(folder)
    if tokenizer is not None:
        cfg = _with_tokenizer_ids(cfg, tokenizer, hf_config, folder)
    rules = arch.rules(cfg)
    named = {exported: tensors[name] for exported, name in arch.normalise(set(tensors),
                                                                             cfg).items()}
    dropped = sorted(set(named) - {n for rule in rules for n in rule.hf})
    if dropped:
        raise ConversionError(f"{files[0]} holds {len(dropped)} tensor(s) this conversion has no "
                              f"place for, e.g. {dropped[:3]}")
    params = to_zoo_params(rules, named, zoo_shapes(arch.family, cfg), where=str(files[0]))
    return Converted(arch.family, cfg, params, tokenizer, arch.model_type)


def _read_tokenizer(folder: Path):
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return load_hf_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{folder}: its tokenizer cannot be read ({e})") from None


# The config.json key that sets each id, per zoo field (None: the tokenizer decides).
_ID_KEYS = {"pad_id": ("pad_token_id",), "eos_id": ("eos_token_id",),
            "bos_id": ("decoder_start_token_id", "bos_token_id")}


def _with_tokenizer_ids(cfg: ModelConfig, tokenizer, hf_config: dict, folder: Path):
    """cfg with the ids config.json leaves open taken from the tokenizer (which must agree)."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConversionError(f"{folder}: the tokenizer has {tokenizer.vocab_size} ids, the "
                              f"model only {cfg.vocab_size}")
    changes = {}
    for field, keys in _ID_KEYS.items():
        given = next((hf_config[k] for k in keys if hf_config.get(k) is not None), None)
        ours = getattr(tokenizer, field)
        if given is None:
            changes[field] = ours
        elif field != "bos_id" and given != ours:
            raise ConversionError(f"{folder}: config.json's {keys[0]}={given} but the "
                                  f"tokenizer's {field.removesuffix('_id')} id is {ours}")
    return cfg.replace(**changes)


def write_hf(converted: Converted, folder: str | os.PathLike) -> Path:
    """Writes config.json + model.safetensors (+ tokenizer files) to a new `folder`.

    Raises:
      ConversionError: `folder` exists and is not empty, or the model does not
        fit the architecture of its family (names the fields).
    """
    folder = Path(folder)
    check_free(folder)
    arch = BY_FAMILY.get(converted.family)
    if arch is None:
        raise ConversionError(f"no Hugging Face architecture for family {converted.family!r}")
    hf_config = {**arch.config_to_hf(converted.config), "dtype": "float32"}
    tensors = to_hf_tensors(arch.rules(converted.config), converted.params)
    with staging(folder) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        save_tensors(tensors, tmp / SAFETENSORS)
        save_pretrained = getattr(converted.tokenizer, "save_pretrained", None)
        if save_pretrained is not None:
            save_pretrained(tmp)
    return folder


def check_free(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConversionError(f"{path} already exists and is not empty; nothing was written")


@contextlib.contextmanager
def staging(target: Path):
    """A temporary sibling of `target`, renamed to it on success, removed on error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        target.rmdir()  # empty (checked before)
    os.replace(tmp, target)

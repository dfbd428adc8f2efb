"""Converted models as workdirs: what load_run, train.decode and init_from read.

A converted workdir is a training run's directory with one params-only
checkpoint (step 0) and the tokenizer: checkpoints/0/{params,config} and
tokenizer/. Its saved run config records where it came from.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from transformer_zoo.data import load_tokenizer
from transformer_zoo.train.checkpoint import Checkpointer
from transformer_zoo.train.hf.convert import (
    BY_FAMILY,
    Converted,
    check_free,
    read_hf,
    staging,
    write_hf,
)
from transformer_zoo.train.hf.weights import ConversionError
from transformer_zoo.train.loop import model_config_dict
from transformer_zoo.train.predict import restore_checkpoint


def write_workdir(converted: Converted, workdir: str | os.PathLike,
                  source: str | os.PathLike | None = None) -> Path:
    """Saves `converted` as a new workdir (step 0, params only, and its tokenizer).

    Raises:
      ConversionError: `workdir` exists and is not empty (nothing is written).
    """
    workdir = Path(workdir)
    check_free(workdir)
    saved = {"run": {"converted_from": os.fspath(source) if source else None,
                     "model_type": converted.model_type},
             "model": model_config_dict(converted.config), "family": converted.family}
    with staging(workdir) as tmp:
        checkpointer = Checkpointer(tmp, async_save=False)
        checkpointer.save_params(0, converted.params, saved)
        checkpointer.wait()
        checkpointer.close()
        if converted.tokenizer is not None:
            converted.tokenizer.save(tmp / "tokenizer")
    return workdir


def from_hf(source: str | os.PathLike, workdir: str | os.PathLike) -> Converted:
    """Converts a Hugging Face folder into a new workdir; returns what was converted."""
    converted = read_hf(source)
    write_workdir(converted, workdir, source=Path(source).absolute())
    return converted


def read_workdir(workdir: str | os.PathLike, step: int | None = None) -> Converted:
    """A workdir's checkpoint (default: the latest) and tokenizer in zoo terms."""
    restored = restore_checkpoint(workdir, step)
    arch = BY_FAMILY.get(restored.family)
    if arch is None:
        raise ConversionError(f"{workdir}: no Hugging Face architecture for family "
                              f"{restored.family!r}")
    tokenizer_dir = Path(workdir) / "tokenizer"
    tokenizer = load_tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() \
        else None
    params = jax.tree.map(np.asarray, restored.params)
    return Converted(restored.family, restored.model.config, params, tokenizer, arch.model_type)


def to_hf(workdir: str | os.PathLike, folder: str | os.PathLike,
          step: int | None = None) -> Converted:
    """Writes a workdir's checkpoint as a new Hugging Face folder; returns what was written."""
    check_free(Path(folder))
    converted = read_workdir(workdir, step)
    write_hf(converted, folder)
    return converted

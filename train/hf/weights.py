"""Reading and writing a Hugging Face folder's weights as numpy arrays.

safetensors files (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`) are read and written with numpy: converting
needs no torch. A folder that has only `pytorch_model.bin` is read with torch
(`weights_only=True`, which unpickles tensors and nothing else) when torch is
installed; the error says what to do when it is not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"


class ConversionError(ValueError):
    """A folder or workdir that cannot be converted (the message says why)."""


def weight_files(folder: Path) -> list[Path]:
    """The weight files of `folder`, in the order to read them.

    Raises:
      ConversionError: none of model.safetensors, its index or pytorch_model.bin.
    """
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS]
    if (folder / SAFETENSORS_INDEX).is_file():
        index = read_json(folder / SAFETENSORS_INDEX)
        shards = sorted(set(index.get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if not shards or missing:
            raise ConversionError(f"{folder / SAFETENSORS_INDEX} lists shards that are missing: "
                                  f"{missing or 'none listed'}")
        return [folder / s for s in shards]
    if (folder / PYTORCH_BIN).is_file():
        return [folder / PYTORCH_BIN]
    raise ConversionError(f"{folder} has no weights: looked for {SAFETENSORS}, "
                          f"{SAFETENSORS_INDEX} and {PYTORCH_BIN}")


def read_json(path: Path) -> dict:
    """A JSON object from `path`; ConversionError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def load_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    """Every tensor of `files` (from `weight_files`), by name."""
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        part = _load_bin(path) if path.name == PYTORCH_BIN else _load_safetensors(path)
        tensors.update(part)
    return tensors


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(os.fspath(path))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ConversionError(f"{path} is not a readable safetensors file "
                              f"({type(e).__name__}: {e})") from None


def _load_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConversionError(
            f"{path} is a PyTorch pickle, which needs torch to read: pip install torch, or "
            "save the model with safetensors (save_pretrained's default)") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConversionError(f"{path} is not a readable PyTorch checkpoint ({e})") from None
    return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            for k, v in state.items()}


def save_tensors(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    """Writes one safetensors file with the "pt" format tag transformers expects."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.fspath(path),
              metadata={"format": "pt"})

"""Fixed-shape batches from token-id examples: packing, padding and its inverse.

An example is a dict of int arrays: ``inputs`` and/or ``targets`` (1-D, ending
in EOS_ID), optionally ``labels`` (a scalar class id, or 1-D token labels aligned
with ``inputs``). A batch is a dict of int32 numpy arrays:

* ``inputs`` [B, S], ``targets`` [B, T]: ids, PAD_ID (0) after the content.
* ``<f>_segmentation``: 1, 2, 3, ... for the 1st, 2nd, 3rd example packed into a
  row, 0 on padding (an unpacked row is 1 on its tokens).
* ``<f>_position``: 0, 1, 2, ... restarting at every segment, 0 on padding.
* ``labels``: [B] for scalar labels (unpacked rows only), [B, S] when aligned
  with ``inputs`` (placed at the same offsets, 0 on padding).

Rows without any example (the tail of the last evaluation batch) are all zero,
so their segmentation tells the loss to ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

SEGMENTED = ("inputs", "targets")
LABELS = "labels"
Example = Mapping[str, np.ndarray | int]
Batch = dict[str, np.ndarray]


def example_length(example: Example, feature: str) -> int:
    """Tokens of ``feature`` in ``example`` (0 if absent)."""
    return len(example[feature]) if feature in example else 0


def _check_example(example: Example) -> None:
    if not any(f in example for f in SEGMENTED):
        raise ValueError(f"example needs 'inputs' or 'targets', got keys {sorted(example)}")
    labels = example.get(LABELS)
    if (labels is not None and np.ndim(labels) == 1
            and len(labels) != example_length(example, "inputs")):
        raise ValueError(
            f"token labels must align with inputs: len(labels)={len(labels)}, "
            f"len(inputs)={example_length(example, 'inputs')}"
        )


def rows_to_batch(rows: Sequence[Sequence[Example]], num_rows: int,
                  lengths: Mapping[str, int]) -> Batch:
    """Lays out ``rows`` (each a list of examples packed left to right) as a batch.

    Args:
      rows: at most ``num_rows`` lists of examples; empty lists are empty rows.
      num_rows: B, the batch's row count (missing rows are all padding).
      lengths: row length per segmented feature, e.g. {"inputs": S, "targets": T};
        every feature of the examples must be present.

    Returns:
      The batch dict described in the module docstring.
    """
    if len(rows) > num_rows:
        raise ValueError(f"got {len(rows)} rows for a batch of num_rows={num_rows}")
    first = next((ex for row in rows for ex in row), None)
    if first is None:
        raise ValueError("rows_to_batch: no examples")
    features = [f for f in SEGMENTED if f in first]
    batch: Batch = {}
    for f in features:
        for suffix in ("", "_segmentation", "_position"):
            batch[f + suffix] = np.zeros((num_rows, lengths[f]), np.int32)
    scalar_labels = LABELS in first and np.ndim(first[LABELS]) == 0
    if LABELS in first:
        shape = (num_rows,) if scalar_labels else (num_rows, lengths["inputs"])
        batch[LABELS] = np.zeros(shape, np.int32)
    for r, row in enumerate(rows):
        if scalar_labels and len(row) > 1:
            raise ValueError("scalar 'labels' (classification) cannot be packed; use bucketing")
        _fill_row(batch, r, row, features)
    return batch


def _fill_row(batch: Batch, r: int, row: Sequence[Example], features: Sequence[str]) -> None:
    offsets = dict.fromkeys(features, 0)
    for segment, example in enumerate(row, start=1):
        for f in features:
            ids = np.asarray(example[f])
            start, end = offsets[f], offsets[f] + len(ids)
            if end > batch[f].shape[1]:
                raise ValueError(f"{f} of length {len(ids)} does not fit row length "
                                 f"{batch[f].shape[1]} at offset {start}")
            batch[f][r, start:end] = ids
            batch[f + "_segmentation"][r, start:end] = segment
            batch[f + "_position"][r, start:end] = np.arange(len(ids))
            offsets[f] = end
        if LABELS in example:
            if batch[LABELS].ndim == 1:
                batch[LABELS][r] = example[LABELS]
            else:
                start = offsets["inputs"] - example_length(example, "inputs")
                batch[LABELS][r, start:offsets["inputs"]] = example[LABELS]


class RowPacker:
    """Greedy first-fit packing of examples into ``num_rows`` rows.

    Each example goes into the first row with room for all of its segmented
    features; ``add`` returns False when no row has room (the batch is full).
    """

    def __init__(self, num_rows: int, lengths: Mapping[str, int]):
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.num_rows = num_rows
        self.lengths = dict(lengths)
        self._free = {f: np.full(num_rows, n, np.int64) for f, n in self.lengths.items()}
        self._rows: list[list[Example]] = [[] for _ in range(num_rows)]
        self.num_examples = 0

    def add(self, example: Example) -> bool:
        _check_example(example)
        if LABELS in example and np.ndim(example[LABELS]) == 0:
            raise ValueError("scalar 'labels' (classification) cannot be packed; use bucketing")
        fits = np.ones(self.num_rows, bool)
        for f, free in self._free.items():
            n = example_length(example, f)
            if n > self.lengths[f]:
                raise ValueError(f"{f} of length {n} exceeds the packed length {self.lengths[f]}")
            fits &= free >= n
        if not fits.any():
            return False
        r = int(np.argmax(fits))  # The first row with room: first-fit.
        for f, free in self._free.items():
            free[r] -= example_length(example, f)
        self._rows[r].append(example)
        self.num_examples += 1
        return True

    def batch(self) -> Batch:
        """The packed batch of everything added so far."""
        return rows_to_batch(self._rows, self.num_rows, self.lengths)


def pack(examples: Sequence[Example], num_rows: int, lengths: Mapping[str, int]) -> Batch:
    """Packs all ``examples`` into one batch (ValueError if they do not fit)."""
    packer = RowPacker(num_rows, lengths)
    for i, example in enumerate(examples):
        if not packer.add(example):
            raise ValueError(f"example {i} does not fit in {num_rows} rows of {lengths}")
    return packer.batch()


def pad(examples: Sequence[Example], num_rows: int, length: int) -> Batch:
    """One example per row, every segmented feature padded to ``length``."""
    for example in examples:
        _check_example(example)
    first = examples[0] if examples else {}
    lengths = {f: length for f in SEGMENTED if f in first}
    return rows_to_batch([[ex] for ex in examples], num_rows, lengths)


def unpack(batch: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray | int]]:
    """The examples of a (packed or padded) batch, in row-major order.

    The inverse of ``pack``/``pad`` up to row assignment: padding is dropped,
    empty rows yield nothing. Arrays come back as int32 numpy arrays.
    """
    features = [f for f in SEGMENTED if f in batch]
    if not features:
        raise ValueError(f"batch needs 'inputs' or 'targets', got keys {sorted(batch)}")
    examples = []
    for r in range(batch[features[0]].shape[0]):
        segments = max(int(batch[f + "_segmentation"][r].max(initial=0)) for f in features)
        for s in range(1, segments + 1):
            example: dict[str, np.ndarray | int] = {}
            for f in features:
                example[f] = batch[f][r][batch[f + "_segmentation"][r] == s]
            if LABELS in batch:
                labels = batch[LABELS]
                example[LABELS] = (int(labels[r]) if labels.ndim == 1
                                   else labels[r][batch["inputs_segmentation"][r] == s])
            examples.append(example)
    return examples

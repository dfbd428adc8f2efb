"""Pictures of a run as PNG files: attention maps, training curves, position encodings.

Matplotlib's object API on the Agg canvas (no display, no pyplot state). Text is
set in DejaVu Sans, which matplotlib ships and which covers Latin, Greek and
Cyrillic; a character it lacks comes from the next font of FONTS (STIX, then
matplotlib's Last Resort font, which draws a visible sign for any code point),
and one that no installed font covers is written as U+XXXX, never as an empty box.
Every function writes one PNG at DPI dots per inch and returns its path.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import font_manager, ft2font, rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from transformer_zoo.models import alibi_slopes, apply_rope, sinusoidal_encoding

Array = Any

DPI = 100
# The preferred fonts, in fallback order; those not installed are left out.
PREFERRED_FONTS = ("DejaVu Sans", "STIXGeneral", "Last Resort High-Efficiency")
# Tokens that are (or start with) whitespace would be invisible as tick labels.
_SHOWN = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "": "\u2205"}
_CELL_INCHES = 0.17  # per token of an attention map: room for a 7-point label
_FONT_SIZE = 7


@functools.cache
def fonts() -> tuple[str, ...]:
    """The installed PREFERRED_FONTS (matplotlib's `font.family` fallback list)."""
    installed = {f.name for f in font_manager.fontManager.ttflist}
    return tuple(name for name in PREFERRED_FONTS if name in installed) or ("sans-serif",)


@functools.cache
def _font_files() -> tuple[Any, ...]:
    paths = [font_manager.findfont(font_manager.FontProperties(family=[name]),
                                   fallback_to_default=False) for name in fonts()
             if name != "sans-serif"]
    return tuple(ft2font.FT2Font(p) for p in paths)


def _has_glyph(char: str) -> bool:
    return any(f.get_char_index(ord(char)) for f in _font_files())


def token_label(token: str) -> str:
    """`token` as a tick label: whitespace made visible, glyphs no font has as U+XXXX."""
    if token in _SHOWN:
        return _SHOWN[token]
    text = "".join(_SHOWN.get(c, c) if c.isspace() else c for c in token)
    return "".join(c if _has_glyph(c) else f"U+{ord(c):04X}" for c in text)


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _style():
    return rc_context({"font.family": list(fonts()), "font.size": _FONT_SIZE + 1,
                       "axes.titlesize": _FONT_SIZE + 2})


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def _check_tokens(weights, q_tokens, k_tokens, what: str) -> None:
    T, S = weights.shape[-2:]
    if len(q_tokens) != T or len(k_tokens) != S:
        raise ValueError(f"{what}: weights have {T} queries x {S} keys, got {len(q_tokens)} "
                         f"query and {len(k_tokens)} key tokens")


def _heatmap(ax, weights, q_tokens, k_tokens, *, x_labels: bool, y_labels: bool):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=max(float(weights.max()), 1e-6),
                      aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(k_tokens)))
    ax.set_yticks(range(len(q_tokens)))
    ax.set_xticklabels([token_label(t) for t in k_tokens] if x_labels else [], rotation=90,
                       fontsize=_FONT_SIZE)
    ax.set_yticklabels([token_label(t) for t in q_tokens] if y_labels else [],
                       fontsize=_FONT_SIZE)
    ax.tick_params(length=0)
    return image


def _label_margin(tokens: Sequence[str]) -> float:
    """Inches for tick labels as long as the longest token (7-point text)."""
    return 0.12 * max((len(token_label(t)) for t in tokens), default=1) + 0.8


def attention_grid_inches(layers: int, heads: int, q_tokens: Sequence[str],
                          k_tokens: Sequence[str]) -> tuple[float, float]:
    """(width, height) in inches of `attention_grid`'s figure (pixels: times DPI).

    Each map is max(1.2, 0.17 * tokens) inches per side, plus the tick labels'
    margin and 0.6 inches for the titles.
    """
    margin = _label_margin([*q_tokens, *k_tokens])
    cell_w = max(1.2, _CELL_INCHES * len(k_tokens))
    cell_h = max(1.2, _CELL_INCHES * len(q_tokens))
    return heads * cell_w + margin + 0.6, layers * cell_h + margin + 0.6


def attention_grid(weights: Array, q_tokens: Sequence[str], k_tokens: Sequence[str], path,
                   title: str = "attention") -> Path:
    """Attention weights of every layer and head as a layers x heads grid of heatmaps.

    Args:
      weights: [L, N, T, S] weights of one example over L layers (rows are queries).
      q_tokens: T query tokens (the y tick labels of the first column).
      k_tokens: S key tokens (the x tick labels of the bottom row).
      path: the PNG to write.
      title: the figure's title.

    Each map has its own colour scale, from 0 to its largest weight; the image
    is `attention_grid_inches(...)` x DPI pixels.

    Returns:
      `path`.

    Raises:
      ValueError: weights not [L, N, T, S], or token counts that disagree with T, S.
    """
    weights = np.asarray(weights, np.float32)
    if weights.ndim != 4:
        raise ValueError(f"attention_grid: weights must be [L, N, T, S], got shape "
                         f"{weights.shape}")
    _check_tokens(weights, q_tokens, k_tokens, "attention_grid")
    L, N = weights.shape[:2]
    with _style():
        fig = _figure(*attention_grid_inches(L, N, q_tokens, k_tokens))
        axes = fig.subplots(L, N, squeeze=False)
        for layer in range(L):
            for head in range(N):
                ax = axes[layer, head]
                _heatmap(ax, weights[layer, head], q_tokens, k_tokens,
                         x_labels=layer == L - 1, y_labels=head == 0)
                ax.set_title(f"layer {layer}, head {head}", fontsize=_FONT_SIZE)
        fig.suptitle(title)
        return _save(fig, path)


def alignment(weights: Array, source_tokens: Sequence[str], target_tokens: Sequence[str], path,
              title: str = "cross-attention alignment") -> Path:
    """One cross-attention map: target tokens (rows) against source tokens (columns).

    Args:
      weights: [T, S], e.g. the last decoder layer's weights averaged over heads.
      source_tokens: S source tokens (x tick labels).
      target_tokens: T target tokens (y tick labels).
      path: the PNG to write.
      title: the figure's title.

    Returns:
      `path`.

    Raises:
      ValueError: weights not [T, S], or token counts that disagree with T, S.
    """
    weights = np.asarray(weights, np.float32)
    if weights.ndim != 2:
        raise ValueError(f"alignment: weights must be [T, S], got shape {weights.shape}")
    _check_tokens(weights, target_tokens, source_tokens, "alignment")
    T, S = weights.shape
    margin = _label_margin([*source_tokens, *target_tokens]) + 0.2
    with _style():
        fig = _figure(max(3.0, 0.3 * S) + margin + 0.8, max(2.5, 0.3 * T) + margin)
        ax = fig.subplots()
        image = _heatmap(ax, weights, target_tokens, source_tokens, x_labels=True,
                         y_labels=True)
        ax.set_xlabel("source")
        ax.set_ylabel("target")
        ax.set_title(title, loc="left")
        fig.colorbar(image, ax=ax, fraction=0.08, pad=0.02)
        return _save(fig, path)


def _read_metrics(path: Path) -> dict[str, dict[int, dict[str, float]]]:
    """{split: {step: row}} of a metrics.jsonl; a step written twice keeps its last row."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: no metrics to plot")
    splits: dict[str, dict[int, dict[str, float]]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number} is not JSON: {err}") from None
        splits.setdefault(str(row.get("split", "train")), {})[int(row["step"])] = row
    return splits


# The panels of training_curves: (title, metric keys), drawn when any split has a key.
CURVE_PANELS = (
    ("loss", ("loss",)),
    ("accuracy", ("accuracy",)),
    ("learning rate", ("learning_rate",)),
    ("BLEU / chrF", ("bleu", "chrf")),
    ("exact match", ("exact_match",)),
)


def _panels(splits) -> list[tuple[str, tuple[str, ...]]]:
    keys = {k for rows in splits.values() for row in rows.values() for k in row}
    return [(title, names) for title, names in CURVE_PANELS if keys & set(names)]


# One colour per split in every panel; a second metric of a panel is dashed.
_SPLIT_COLORS = {"train": "C0", "eval": "C1", "final": "C3"}


def _draw_curves(ax, splits, names: Sequence[str]) -> None:
    for split in sorted(splits, key=lambda s: (s not in _SPLIT_COLORS, s)):
        for index, name in enumerate(names):
            points = sorted((s, r[name]) for s, r in splits[split].items() if name in r)
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            label = f"{split} {name}" if len(names) > 1 else split
            style = dict(marker="*", markersize=10, linestyle="none", zorder=3) if (
                split == "final") else dict(marker="o" if len(points) < 20 else None,
                                            markersize=3, linestyle="-" if index == 0 else "--")
            ax.plot(steps, values, label=label, color=_SPLIT_COLORS.get(split), **style)
    ax.set_xlabel("step")
    ax.legend(fontsize=_FONT_SIZE)
    ax.grid(alpha=0.3)


def training_curves(metrics_jsonl_path, out_path) -> Path:
    """Loss, accuracy, learning rate and BLEU/chrF or exact match of a run, one panel each.

    Reads WORKDIR/metrics.jsonl (rows {"step", "split": train|eval|final, ...});
    a panel is drawn only for metrics present, each split a line ("final" a star).

    Args:
      metrics_jsonl_path: the run's metrics.jsonl.
      out_path: the PNG to write.

    Returns:
      `out_path`.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a line is not JSON, or no row has any of the plotted metrics.
    """
    path = Path(metrics_jsonl_path)
    splits = _read_metrics(path)
    panels = _panels(splits)
    if not panels:
        raise ValueError(f"{path} has no {', '.join(k for _, ks in CURVE_PANELS for k in ks)} "
                         "to plot")
    columns = min(len(panels), 3)
    rows = math.ceil(len(panels) / columns)
    with _style():
        fig = _figure(4.0 * columns, 3.0 * rows)
        axes = fig.subplots(rows, columns, squeeze=False).ravel()
        for ax, (title, names) in zip(axes, panels, strict=False):
            _draw_curves(ax, splits, names)
            ax.set_title(title)
            if names == ("learning_rate",):
                ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(f"training curves ({path.parent.name or path})")
        return _save(fig, out_path)


def _position_data(config, length: int) -> dict[str, np.ndarray]:
    """The arrays of the four pictures for `length` positions."""
    positions = np.arange(length, dtype=np.int32)[None]
    concat = str(config.position_encoding) == "sinusoidal_concat"
    d_model = config.d_model + config.d_model % 2
    table = np.asarray(sinusoidal_encoding(positions, d_model, concat=concat))[0]  # [P, D]
    head_dim = config.head_dim or config.d_model // config.num_heads
    head_dim = max(2, head_dim + head_dim % 2)
    ones = np.ones((1, length, 1, head_dim), np.float32)
    rotated = np.asarray(apply_rope(ones, positions, config.rope_base))[0, :, 0]  # [P, H]
    slopes = alibi_slopes(config.num_heads)
    return {
        "table": table,
        # PE(p) . PE(p + k) for p = 0 and p = P / 4: the same curve (it depends on k only).
        "dot": np.stack([table[p] @ table[p:p + length // 2].T for p in (0, length // 4)]),
        # q at position d against k at 0 (both all-ones): <R(d) q, R(0) k> / sqrt(H).
        "rope": rotated @ rotated[0] / math.sqrt(head_dim),
        "alibi": -slopes[:, None] * np.arange(length, dtype=np.float32)[None],
        "slopes": slopes,
    }


def _draw_table(ax, data, fig):
    image = ax.imshow(data["table"], cmap="RdBu", aspect="auto", vmin=-1, vmax=1,
                      interpolation="nearest")
    ax.set(xlabel="dimension", ylabel="position", title="sinusoidal PE(position, dimension)")
    fig.colorbar(image, ax=ax, shrink=0.8)


def _draw_dot(ax, data, fig):
    length = data["table"].shape[0]
    for p, curve in zip((0, length // 4), data["dot"], strict=True):
        ax.plot(np.arange(curve.shape[0]), curve, label=f"p = {p}",
                linestyle="-" if p == 0 else "--")
    ax.set(xlabel="offset k", ylabel="PE(p) \u00b7 PE(p + k)",
           title="sinusoidal: similarity depends on the offset only")
    ax.legend(fontsize=_FONT_SIZE)
    ax.grid(alpha=0.3)


def _draw_rope(ax, data, fig):
    ax.plot(np.arange(data["rope"].shape[0]), data["rope"])
    ax.set(xlabel="relative distance", ylabel="score q\u00b7k / \u221aH",
           title="RoPE: score of constant q, k against distance")
    ax.grid(alpha=0.3)


def _draw_alibi(ax, data, fig):
    for head, (bias, slope) in enumerate(zip(data["alibi"], data["slopes"], strict=True)):
        ax.plot(np.arange(bias.shape[0]), bias, label=f"head {head} (m = {slope:.3g})")
    ax.set(xlabel="distance |i - j|", ylabel="bias -m |i - j|", title="ALiBi: per-head bias")
    ax.legend(fontsize=_FONT_SIZE - 1, ncol=2)
    ax.grid(alpha=0.3)


# file stem -> (drawing function, the position encodings it applies to)
_POSITION_PICTURES = {
    "positions_sinusoidal": (_draw_table, ("sinusoidal", "sinusoidal_concat")),
    "positions_sinusoidal_offsets": (_draw_dot, ("sinusoidal", "sinusoidal_concat")),
    "positions_rope": (_draw_rope, ("rope",)),
    "positions_alibi": (_draw_alibi, ("alibi",)),
}


def position_pictures(config, out_dir, length: int | None = None) -> list[Path]:
    """Pictures of the position encodings: those `config` uses, and all four together.

    Writes, for `config.position_encoding`: sinusoidal(_concat) ->
    positions_sinusoidal.png (the positions x dimensions matrix) and
    positions_sinusoidal_offsets.png (PE(p).PE(p+k) against k); rope ->
    positions_rope.png (the score of constant q/k against relative distance);
    alibi -> positions_alibi.png (each head's bias against distance); learned
    and none -> nothing of their own. Always positions_explained.png, the four
    side by side for this config's sizes.

    Args:
      config: a ModelConfig (d_model, num_heads, head_dim, rope_base,
        max_length, position_encoding are read).
      out_dir: the folder to write into.
      length: positions shown (default max_length, between 16 and 256).

    Returns:
      the paths written, explanatory picture last.
    """
    length = length or min(max(config.max_length, 16), 256)
    if length < 2:
        raise ValueError(f"position_pictures: length must be >= 2, got {length}")
    data = _position_data(config, length)
    out_dir = Path(out_dir)
    written = []
    with _style():
        for stem, (draw, encodings) in _POSITION_PICTURES.items():
            if str(config.position_encoding) in encodings:
                fig = _figure(5.5, 4.0)
                draw(fig.subplots(), data, fig)
                written.append(_save(fig, out_dir / f"{stem}.png"))
        fig = _figure(11.0, 8.0)
        for ax, (draw, _) in zip(fig.subplots(2, 2).ravel(), _POSITION_PICTURES.values(),
                                 strict=True):
            draw(ax, data, fig)
        fig.suptitle(f"position encodings (D = {config.d_model}, N = {config.num_heads}; "
                     f"this model: {config.position_encoding})")
        written.append(_save(fig, out_dir / "positions_explained.png"))
    return written

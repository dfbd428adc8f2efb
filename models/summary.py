r"""A model's summary: parameters per module, FLOPs per token, activation memory.

    python -m transformer_zoo.models.summary --preset base | --config FILE | --workdir DIR
        [--family encoder_decoder] [--seq_len 512] [--vocab_size V]

The library part is pure computation on a ModelConfig and a family name
(encoder_decoder, decoder_only, encoder_only):

* `parameter_table`: the parameters of the real model (`jax.eval_shape` of its
  init, so nothing is allocated), per module and kind.
* `flops_per_token`: forward and training-step FLOPs per token from the matmuls.
* `activation_memory`: an estimate of the activation bytes kept for the backward
  pass per sequence.
* `format_summary`: all three as an aligned terminal table.

The command prints that table for a named preset (`models.get_preset`), a
recipe file (as `python -m transformer_zoo.train --config` reads it) or the
saved model config of a run directory's latest checkpoint. Bad input (an
unknown preset, a missing file or workdir, no source or two) exits with code 1
and one line `error: ...` on stderr.

Shape letters (models/__init__.py): B batch, T query length, S key/value length,
N heads, K key/value heads, H head dim, D model dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import sys
from collections.abc import Sequence

import flax.linen as nn
import jax

from transformer_zoo.models.config import ModelConfig, get_preset
from transformer_zoo.models.hardware_attention import AUTO_LONG_SEQUENCE
from transformer_zoo.models.mlp import ACTIVATIONS
from transformer_zoo.models.variants import AttentionImpl, FfnActivation

PROG = "python -m transformer_zoo.models.summary"
DEFAULT_SEQ_LEN = 512
DEFAULT_SEQ_LENS = (128, 512, 2048)
# Softmax probabilities and logits are float32 whatever the compute dtype (DESIGN.md).
FLOAT32_BYTES = 4


class Kind(enum.StrEnum):
    """What a parameter is for (one row of the per-kind totals)."""

    EMBEDDINGS = "embeddings"  # token, position and token-type tables
    ATTENTION = "attention"  # query, key, value and output projections
    FFN = "ffn"
    NORMS = "norms"
    HEADS = "heads"  # untied output projection, output bias, MLM transform, pooler, classifier


# Module names that decide a parameter's kind (the rest of the path is placement).
_ATTENTION_MODULES = ("self_attention", "cross_attention")
_HEAD_MODULES = ("logits", "logits_bias", "token_head", "mlm_dense", "pooler", "classifier")
# Heads applied once per sequence, not per token (their FLOPs are spread over the sequence).
_PER_SEQUENCE_HEADS = ("pooler", "classifier")
# What `kind` a path component implies, tried in order.
_KIND_OF = (
    (lambda name: name in _ATTENTION_MODULES, Kind.ATTENTION),
    (lambda name: name == "ffn", Kind.FFN),
    (lambda name: name.endswith("norm"), Kind.NORMS),
    (lambda name: name in _HEAD_MODULES, Kind.HEADS),
    (lambda name: name.endswith(("embed", "embedding")), Kind.EMBEDDINGS),
)


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """The parameters of one module.

    Attributes:
      module: its path in the parameter tree, cut after the component that
        decides its kind, e.g. "encoder/layer_0/self_attention".
      kind: what the parameters are for.
      count: number of parameters (weights, biases, scales).
      matmul: of those, the entries of matmul kernels (the `kernel` arrays,
        not biases, norm scales or embedding tables).
    """

    module: str
    kind: Kind
    count: int
    matmul: int


@dataclasses.dataclass(frozen=True)
class ParamTable:
    """Every module's parameters, in model order (embeddings, encoder, decoder, heads)."""

    rows: tuple[ParamRow, ...]

    @property
    def total(self) -> int:
        return sum(row.count for row in self.rows)

    def by_kind(self) -> dict[Kind, int]:
        """Parameters per kind (every kind, zero where the model has none)."""
        out = dict.fromkeys(Kind, 0)
        for row in self.rows:
            out[row.kind] += row.count
        return out

    def matmul(self, *kinds: Kind, modules: Sequence[str] = ()) -> int:
        """Matmul kernel entries of `kinds` (all kinds if none), only in `modules` if given."""
        return sum(row.matmul for row in self.rows
                   if (not kinds or row.kind in kinds)
                   and (not modules or row.module.split("/")[-1] in modules))


def _task(family):
    """The family's train.tasks.Task (imported here: models/ must not import train/)."""
    from transformer_zoo.train.tasks import get_task

    return get_task(family)


def abstract_params(config: ModelConfig, family) -> dict:
    """ShapeDtypeStructs of the real model's parameters (`jax.eval_shape`, no memory).

    Args:
      config: the model.
      family: "encoder_decoder", "decoder_only" or "encoder_only" (or a train Task).

    Raises:
      ValueError: an unknown family.
    """
    task = _task(family)
    model = task.build(config)
    batch = task.dummy_batch()
    variables = jax.eval_shape(lambda key: model.init(key, **batch), jax.random.key(0))
    return nn.meta.unbox(variables["params"])


def _module_and_kind(path: tuple[str, ...]) -> tuple[str, Kind]:
    """A parameter path's module (cut after the deciding component) and kind.

    The parameter's own name decides only where no module does (`logits_bias`).
    """
    for i, name in enumerate(path):
        for test, kind in _KIND_OF:
            if test(name):
                return "/".join(path[:i + 1]), kind
    return "/".join(path[:-1][:3] or path), Kind.HEADS


def _natural(text: str) -> list:
    """Sort key with numbers compared as numbers (layer_10 after layer_9)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


# Where a path component sorts among its siblings: the order of the forward pass
# (other names, such as layer_<i>, sort naturally at 50).
_PLACE = {"embedder": 0, "self_attention": 10, "attention_residual": 11, "cross_attention": 12,
          "cross_residual": 13, "ffn": 14, "ffn_residual": 15, "final_norm": 90, "logits": 91,
          "token_head": 91, "logits_bias": 92, "mlm_dense": 93, "mlm_norm": 94, "pooler": 95,
          "classifier": 96}


def _order(row: ParamRow) -> tuple:
    """Model order: embedding tables, encoder, decoder, heads; the forward pass within."""
    top = row.module.split("/")[0]
    rank = {"encoder": 1, "decoder": 2}.get(top, 0 if row.kind == Kind.EMBEDDINGS else 3)
    return rank, [(_PLACE.get(name, 50), _natural(name)) for name in row.module.split("/")]


def parameter_table(config: ModelConfig, family) -> ParamTable:
    """The parameters of `family`'s model built from `config`, per module.

    Counted from `jax.eval_shape` of the model's init (the real parameter tree,
    so every variant field is reflected). A shared embedding is one table and
    counted once.

    Args:
      config: the model.
      family: "encoder_decoder", "decoder_only" or "encoder_only".

    Returns:
      a ParamTable whose rows sum to the model's parameter count.

    Raises:
      ValueError: an unknown family.
    """
    counts: dict[tuple[str, Kind], list[int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(config, family))[0]:
        names = tuple(str(getattr(k, "key", k)) for k in path)
        size = math.prod(leaf.shape)
        entry = counts.setdefault(_module_and_kind(names), [0, 0])
        entry[0] += size
        entry[1] += size if names[-1] == "kernel" else 0
    rows = [ParamRow(module, kind, count, matmul)
            for (module, kind), (count, matmul) in counts.items()]
    return ParamTable(tuple(sorted(rows, key=_order)))


# ---------------------------------------------------------------------------
# FLOPs.


def _check_positive(value: int, name: str = "seq_len") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _family(family) -> str:
    return str(_task(family).family)


def _layer_counts(config: ModelConfig, family) -> dict[str, int]:
    """Attention blocks of each kind: encoder self, decoder self (causal), cross."""
    fam = _family(family)
    enc = config.num_encoder_layers if fam in ("encoder_decoder", "encoder_only") else 0
    dec = config.num_decoder_layers if fam in ("encoder_decoder", "decoder_only") else 0
    return {"encoder": enc, "decoder": dec, "cross": dec if fam == "encoder_decoder" else 0}


def _output_vocab(config: ModelConfig, family) -> int:
    if _family(family) == "encoder_only":  # the token head predicts the inputs
        return config.resolved_input_vocab_size
    return config.vocab_size


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs per token (a multiply-add is 2 FLOPs).

    Attributes:
      seq_len: the sequence length L (T = S = L).
      forward: the forward pass.
      train: one training step: forward + backward = 3 x forward.
      parts: the forward pass by term: "matmuls" (2 x the matmul parameters of
        the layers), "attention" (QK^T and AV), "output" (2 x D x V) and
        "heads" (the MLM transform, pooler and classifier).
      layer_params: the matmul parameters of the layers used once per token.
    """

    seq_len: int
    forward: int
    train: int
    parts: dict[str, int]
    layer_params: int


def attention_flops(config: ModelConfig, family, seq_len: int) -> int:
    """Forward FLOPs per token of the score products QK^T and AV over all layers.

    Per attention block and query token: 2 x S x N x H (QK^T) + 2 x S x N x Hv
    (AV), i.e. 2 x 2 x S x d_attn when Hv = H; S = seq_len for self- and
    cross-attention. Causal masking does not halve it: the scores are computed
    densely and masked.
    """
    _check_positive(seq_len)
    heads = config.num_heads
    h = config.resolved_head_dim
    hv = h if config.v_head_dim is None else config.v_head_dim
    blocks = sum(_layer_counts(config, family).values())
    return blocks * 2 * seq_len * heads * (h + hv)


def flops_per_token(config: ModelConfig, family, seq_len: int = DEFAULT_SEQ_LEN) -> Flops:
    """Forward and training-step FLOPs per token, counted from the matmuls.

    forward = 2 x P + A + 2 x D x V + heads, where

    * P: the matmul parameters of the layers (attention projections and FFN
      kernels of every block, from the real parameter tree; biases, norms and
      embedding lookups are left out, as in the paper-style estimate),
    * A: `attention_flops`, 2 x 2 x L x d_attn per attention block (encoder
      self-, decoder self- and cross-attention),
    * 2 x D x V: the output projection (the tied embedding table or the untied
      `logits` kernel; the encoder-only token head over its input vocabulary),
    * heads: 2 x the MLM transform's kernel, plus 2 x the pooler's and the
      classifier's kernels / L (they run once per sequence).

    train = 3 x forward (the backward pass is twice the forward: gradients of
    activations and of weights). A "token" is one position of the sequence;
    for encoder-decoder one target token together with one source token
    (S = T = L), so each layer's parameters are used once per token. With N =
    every parameter (the tied table counted once), train ~= 6 x N + 3 x A
    (biases and norms make up the difference).

    Raises:
      ValueError: an unknown family or a seq_len that is not a positive integer.
    """
    _check_positive(seq_len)
    table = parameter_table(config, family)
    layers = table.matmul(Kind.ATTENTION, Kind.FFN)
    untied = table.matmul(Kind.HEADS, modules=("logits", "token_head"))
    output = untied or config.d_model * _output_vocab(config, family)
    per_sequence = table.matmul(Kind.HEADS, modules=_PER_SEQUENCE_HEADS)
    heads = table.matmul(Kind.HEADS, modules=("mlm_dense",))
    parts = {"matmuls": 2 * layers, "attention": attention_flops(config, family, seq_len),
             "output": 2 * output, "heads": 2 * heads + round(2 * per_sequence / seq_len)}
    forward = sum(parts.values())
    return Flops(seq_len, forward, 3 * forward, parts, layers)


# ---------------------------------------------------------------------------
# Activation memory.


@dataclasses.dataclass(frozen=True)
class Activations:
    """Estimated activation bytes kept for the backward pass.

    Attributes:
      seq_len: L.
      batch: sequences.
      total: bytes (the sum of `parts`).
      parts: "layers" (per-layer tensors but the scores), "scores" (attention
        probabilities [N, T, S] where materialised, else the log-sum-exp),
        "logits" (float32 [T, V] for the loss) and "other" (embedding dropout,
        final norm, the encoder output read by every cross-attention).
    """

    seq_len: int
    batch: int
    total: int
    parts: dict[str, int]


def _materialises_scores(config: ModelConfig, seq_len: int) -> bool:
    """Whether the attention keeps [N, T, S] probabilities (xla, local; auto when short)."""
    impl = config.attention_impl
    if impl == AttentionImpl.AUTO:
        return seq_len < AUTO_LONG_SEQUENCE  # auto's CPU choice; fused kernels elsewhere
    return impl in (AttentionImpl.XLA, AttentionImpl.LOCAL)


def _keys_per_query(config: ModelConfig, seq_len: int) -> int:
    if config.attention_impl == AttentionImpl.LOCAL and config.attention_window:
        return min(seq_len, 2 * config.attention_window)  # the strip around each block
    return seq_len


def _attention_elements(config: ModelConfig, seq_len: int, *, cross: bool) -> dict[str, int]:
    """Elements (bytes for masks) kept per query token by one attention sublayer."""
    d, heads, kv = config.d_model, config.num_heads, config.resolved_num_kv_heads
    h = config.resolved_head_dim
    hv = h if config.v_head_dim is None else config.v_head_dim
    keys = seq_len if cross else _keys_per_query(config, seq_len)
    # Query input and queries; keys and values (one per source token when S = T);
    # the attention output that enters the output projection; the residual's norm input.
    tensors = d + heads * h + kv * (h + hv) + heads * hv + d
    if _materialises_scores(config, seq_len):
        scores = heads * keys * (2 if config.attention_dropout_rate else 1)
        masks = heads * keys if config.attention_dropout_rate else 0
    else:
        scores, masks = heads, 0  # the log-sum-exp the fused backward recomputes from
    return {"tensors": tensors, "scores": scores, "mask_bytes": masks + _residual_mask(config)}


def _residual_mask(config: ModelConfig) -> int:
    return config.d_model if config.dropout_rate else 0


def _ffn_elements(config: ModelConfig) -> dict[str, int]:
    """Elements kept per token by one FFN sublayer (input, hidden, norm input)."""
    _, gated = ACTIVATIONS[FfnActivation(config.ffn_activation)]
    # Plain: the pre-activation and the activation (wo's input). Gated: both
    # projections, the activation and their product.
    hidden = config.d_ff * (4 if gated else 2)
    if config.activation_dropout_rate:
        hidden += config.d_ff
    masks = (config.d_ff if config.activation_dropout_rate else 0) + _residual_mask(config)
    return {"tensors": 2 * config.d_model + hidden, "scores": 0, "mask_bytes": masks}


def _layer_bytes(config: ModelConfig, family, seq_len: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes per sequence of every block: {"layers": ..., "scores": ...}."""
    counts = _layer_counts(config, family)
    self_attn = _attention_elements(config, seq_len, cross=False)
    cross_attn = _attention_elements(config, seq_len, cross=True)
    ffn = _ffn_elements(config)
    blocks = [(counts["encoder"] + counts["decoder"], self_attn), (counts["cross"], cross_attn),
              (counts["encoder"] + counts["decoder"], ffn)]
    layers = sum(n * (part["tensors"] * dtype_bytes + part["mask_bytes"]) for n, part in blocks)
    scores = sum(n * part["scores"] for n, part in blocks) * FLOAT32_BYTES
    return {"layers": int(layers * seq_len), "scores": int(scores * seq_len)}


def activation_memory(config: ModelConfig, family, seq_len: int, batch: int = 1,
                      dtype_bytes: int | None = None) -> Activations:
    """An estimate of the activation bytes a training step keeps for its backward pass.

    Counted per token and layer from the tensors reverse-mode autodiff needs
    (no rematerialisation): the input of each projection, queries, keys and
    values, the attention probabilities [N, T, S] in float32 where the
    attention implementation materialises them (xla, local, auto below its
    long-sequence threshold; the fused ones keep a log-sum-exp [N, T]), the
    FFN hidden (2 x F, 4 x F gated), each norm's input, dropout masks (1 byte
    an element), and the float32 logits [T, V] of the loss. An estimate: XLA
    may fuse some of these away or keep others (norm statistics, casts).

    Args:
      config: the model.
      family: "encoder_decoder", "decoder_only" or "encoder_only".
      seq_len: L (encoder-decoder: L source and L target tokens).
      batch: sequences.
      dtype_bytes: bytes per activation element; None = config.dtype's.

    Raises:
      ValueError: an unknown family, or a seq_len or batch that is not a positive integer.
    """
    _check_positive(seq_len)
    _check_positive(batch, "batch")
    nbytes = config.dtype.itemsize if dtype_bytes is None else dtype_bytes
    _check_positive(nbytes, "dtype_bytes")
    parts = _layer_bytes(config, family, seq_len, nbytes)
    parts["logits"] = seq_len * _output_vocab(config, family) * FLOAT32_BYTES
    counts = _layer_counts(config, family)
    stacks = (counts["encoder"] > 0) + (counts["decoder"] > 0)
    # Per stack: the embedding dropout mask and the final (pre-norm) or head
    # input; the encoder output, which every cross-attention reads.
    other = stacks * (_residual_mask(config) + config.d_model * nbytes)
    other += config.d_model * nbytes if counts["cross"] else 0
    parts["other"] = other * seq_len
    parts = {k: v * batch for k, v in parts.items()}
    return Activations(seq_len, batch, sum(parts.values()), parts)


# ---------------------------------------------------------------------------
# The table.


def human(n: float) -> str:
    """`n` with a K/M/G/T suffix (3 significant digits): 63082496 -> '63.1M'."""
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}" if isinstance(n, float) else f"{n}"


def human_bytes(n: int) -> str:
    """Bytes in binary units: 78643200 -> '75.0 MiB'."""
    for suffix, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale * 1000 / 1024:  # 1000 KiB reads as 1.0 MiB
            return f"{n / scale:.1f} {suffix}"
    return f"{n} B"


def _grouped(rows: Sequence[ParamRow]) -> list[tuple[str, ParamRow, int]]:
    """Rows of identical layers merged: (label, first row, how many)."""
    groups: dict[tuple, list[tuple[int, ParamRow]]] = {}
    for row in rows:
        match = re.search(r"layer_(\d+)", row.module)
        index = int(match[1]) if match else -1
        template = re.sub(r"layer_\d+", "layer_{}", row.module, count=1)
        groups.setdefault((template, row.kind, row.count), []).append((index, row))
    out = []
    for (template, _, _), members in groups.items():
        indices = [i for i, _ in members]
        span = f"{indices[0]}" if len(indices) == 1 else f"{indices[0]}..{indices[-1]}"
        out.append((template.format(span) if "{}" in template else template, members[0][1],
                    len(members)))
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list:
    """Aligned columns (right-aligned where `right`), two spaces apart."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.rjust(w) if a else c.ljust(w)
                         for c, w, a in zip(cells, widths, right, strict=True)).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _param_lines(table: ParamTable) -> list[str]:
    total = table.total
    rows = [[label, str(row.kind), str(n), f"{n * row.count:,}", f"{n * row.count / total:.1%}"]
            for label, row, n in _grouped(table.rows)]
    rows.append(["total", "", "", f"{total:,}", human(total)])
    lines = _table(["module", "kind", "x", "parameters", "share"], rows,
                   [False, False, True, True, True])
    kinds = ", ".join(f"{kind} {human(n)}" for kind, n in table.by_kind().items())
    return [*lines, f"by kind: {kinds}"]


def _flops_lines(flops: Flops) -> list[str]:
    p = flops.parts
    return [f"FLOPs per token at L={flops.seq_len}: forward {human(flops.forward)} "
            f"({flops.forward:,}), training step {human(flops.train)} (3 x forward)",
            f"  forward = 2 x {human(flops.layer_params)} layer matmul parameters "
            f"{human(p['matmuls'])} + attention {human(p['attention'])} + output "
            f"{human(p['output'])} + heads {human(p['heads'])}"]


def _memory_lines(config: ModelConfig, family, seq_lens: Sequence[int]) -> list[str]:
    estimates = [activation_memory(config, family, n) for n in seq_lens]
    rows = [[str(a.seq_len), human_bytes(a.total),
             *(human_bytes(a.parts[k]) for k in ("layers", "scores", "logits", "other"))]
            for a in estimates]
    title = (f"activation memory per sequence (estimate, {config.dtype.name} activations, "
             "float32 scores and logits):")
    return [title, *_table(["L", "total", "layers", "scores", "logits", "other"], rows,
                           [True] * 6)]


def _title(config: ModelConfig, family) -> str:
    counts = _layer_counts(config, family)
    layers = "+".join(str(counts[k]) for k in ("encoder", "decoder") if counts[k])
    return (f"model: {_family(family)}, {layers} layers, D={config.d_model}, "
            f"N={config.num_heads}, K={config.resolved_num_kv_heads}, "
            f"H={config.resolved_head_dim}, F={config.d_ff}, V={config.vocab_size}"
            + (f" (inputs {config.input_vocab_size})" if config.input_vocab_size else ""))


def format_summary(config: ModelConfig, family, *, seq_len: int = DEFAULT_SEQ_LEN,
                   seq_lens: Sequence[int] = DEFAULT_SEQ_LENS) -> str:
    """The summary as a terminal table.

    Args:
      config: the model.
      family: "encoder_decoder", "decoder_only" or "encoder_only".
      seq_len: L of the FLOPs per token.
      seq_lens: the lengths of the activation-memory table (seq_len is added).

    Returns:
      lines: title, parameters per module (identical layers merged: "x" is how
      many) with total and per-kind totals, FLOPs per token, activation memory.
    """
    _check_positive(seq_len)
    lengths = sorted({*seq_lens, seq_len})
    lines = [_title(config, family), "", *_param_lines(parameter_table(config, family)), "",
             *_flops_lines(flops_per_token(config, family, seq_len)), "",
             *_memory_lines(config, family, lengths)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The command.


def _define_flags(fv) -> None:
    from absl import flags

    kw = {"flag_values": fv}
    flags.DEFINE_string("preset", None, "A named preset of models.get_preset (base, big, tiny).",
                        **kw)
    flags.DEFINE_string("config", None, "A recipe file (configs/*.py), as "
                        "`python -m transformer_zoo.train --config` reads it.", **kw)
    flags.DEFINE_string("workdir", None, "A run directory: its latest checkpoint's model.", **kw)
    flags.DEFINE_string("family", None, "encoder_decoder | decoder_only | encoder_only (default: "
                        "the recipe's or run's; encoder_decoder for a preset).", **kw)
    flags.DEFINE_integer("seq_len", DEFAULT_SEQ_LEN, "L of the FLOPs per token.", **kw)
    flags.DEFINE_integer("vocab_size", None, "V where the recipe leaves it to the tokenizer "
                         "(or to change a preset's).", **kw)


def _load_recipe(path: str):
    """`get_config()` of a recipe file, as ml_collections' config flag loads it."""
    import importlib.util
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config={path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_recipe_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception as err:  # a recipe's own bug, reported in one line
        raise ValueError(f"--config={path} could not be loaded: "
                         f"{type(err).__name__}: {err}") from err


def _recipe_vocab_size(config, given: int | None, path: str) -> int:
    """V of a recipe: model.vocab_size, else --vocab_size, else data.vocab_size."""
    for value in (config.model.get("vocab_size"), given, config.data.get("vocab_size")):
        if value is not None:
            return value
    raise ValueError(f"--config={path} leaves model.vocab_size to the tokenizer and its data "
                     f"task {config.data.get('task')!r} declares none; give --vocab_size")


def _from_recipe(fv) -> tuple[ModelConfig, str]:
    from transformer_zoo.train.tasks import model_config_from

    config = _load_recipe(fv.config)
    vocab = _recipe_vocab_size(config, fv.vocab_size, fv.config)
    return model_config_from(config.model, vocab), config.family


def _from_workdir(fv) -> tuple[ModelConfig, str]:
    """The saved model config of the latest checkpoint (no parameters are read)."""
    from pathlib import Path

    from transformer_zoo.train.checkpoint import Checkpointer

    if not (Path(fv.workdir) / "checkpoints").is_dir():
        raise FileNotFoundError(f"--workdir={fv.workdir} has no checkpoints/ directory")
    ckpt = Checkpointer(fv.workdir, read_only=True, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"--workdir={fv.workdir} holds no complete checkpoint")
    saved = ckpt.restore_config(step)
    return ModelConfig(**saved["model"]), saved["family"]


def _source(fv) -> tuple[ModelConfig, str]:
    """(model config, family) of the one source given."""
    given = [name for name in ("preset", "config", "workdir") if fv[name].value is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of --preset, --config, --workdir (got "
                         + (", ".join(f"--{g}" for g in given) or "none") + ")")
    if given[0] == "preset":
        extra = {} if fv.vocab_size is None else {"vocab_size": fv.vocab_size}
        return get_preset(fv.preset, **extra), fv.family or "encoder_decoder"
    model, family = _from_recipe(fv) if given[0] == "config" else _from_workdir(fv)
    if fv.family is not None and fv.family != family:
        raise ValueError(f"--family={fv.family} contradicts the {given[0]}'s family {family}")
    return model, family


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `argv` without the program name (default sys.argv[1:]); returns the code."""
    import logging

    from absl import flags

    from transformer_zoo.train.cli import one_line, parse_flags

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's read-only notices
    try:
        fv = parse_flags(PROG, __doc__, _define_flags, sys.argv[1:] if argv is None else argv)
        if fv is None:
            return 0
        model, family = _source(fv)
        print(format_summary(model, family, seq_len=fv.seq_len))
    except (flags.Error, OSError, ValueError, TypeError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

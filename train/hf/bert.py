"""BERT (encoder-only): BertModel, BertForMaskedLM, BertForSequenceClassification.

BERT is post-norm with learned positions, token-type embeddings and a
LayerNorm on the embeddings, exact (erf) GELU, biases everywhere, LayerNorm
epsilon 1e-12, and no sqrt(D) embedding scale. Its pooler is tanh(dense) of
the first token ([CLS]); the masked-LM head is dense + GELU + LayerNorm, then
the tied word embeddings plus a bias.
"""

from __future__ import annotations

from collections.abc import Mapping

from transformer_zoo.models import ModelConfig
from transformer_zoo.train.hf import base
from transformer_zoo.train.hf.rules import Rule, attention, layer_norm, linear, same
from transformer_zoo.train.tasks import Family

_MLM = "cls.predictions.transform.dense.weight"
_POOLER = "pooler.dense.weight"
_CLASSIFIER = "classifier.weight"


def _has(names: set[str], key: str) -> bool:
    return key in names or f"bert.{key}" in names


def config_from_hf(hf: Mapping, names: set[str]) -> ModelConfig:
    base.require(hf, "position_embedding_type", ("absolute",), "absolute")
    base.require(hf, "is_decoder", (False,), False)
    classes = None
    if _CLASSIFIER in names:
        classes = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
    mlm = _MLM in names
    return ModelConfig(
        vocab_size=base.number(hf, "vocab_size"),
        d_model=base.number(hf, "hidden_size"),
        num_heads=base.number(hf, "num_attention_heads"),
        d_ff=base.number(hf, "intermediate_size"),
        num_encoder_layers=base.number(hf, "num_hidden_layers"),
        num_decoder_layers=0,
        dropout_rate=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout_rate=hf.get("attention_probs_dropout_prob", 0.1),
        ffn_activation=base.activation(hf, "hidden_act"),
        norm_epsilon=hf.get("layer_norm_eps", 1e-12),
        norm_position="post",
        position_encoding="learned",
        max_length=base.number(hf, "max_position_embeddings"),
        use_bias=True,
        tie_output=True,
        scale_embeddings=False,
        type_vocab_size=hf.get("type_vocab_size", 2),
        embedding_norm=True,
        pooling="first",
        pooler=_has(names, _POOLER) or classes is not None,
        mlm_transform=mlm,
        output_bias=mlm,
        num_classes=classes,
        pad_id=hf.get("pad_token_id") or 0,
    )


def head(cfg: ModelConfig) -> str:
    if cfg.mlm_transform:
        return "BertForMaskedLM"
    return "BertForSequenceClassification" if cfg.num_classes else "BertModel"


def config_to_hf(cfg: ModelConfig) -> dict:
    what = "BERT"
    base.check_exportable(
        cfg, what, norm="layernorm", norm_position="post", position_encoding="learned",
        use_bias=True, tie_output=True, scale_embeddings=False, embedding_norm=True,
        num_kv_heads=(None, cfg.num_heads), head_dim=(None, cfg.d_model // cfg.num_heads),
        v_head_dim=None, score_fn="dot", attention_window=None,
        pooling="first", output_bias=cfg.mlm_transform, output_ids=None)
    if cfg.type_vocab_size < 1:
        raise base.ConversionError(f"this model cannot be written as {what}: it has no "
                                   "token-type embeddings (type_vocab_size=0)")
    out = {
        "model_type": "bert", "architectures": [head(cfg)],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_encoder_layers,
        "hidden_dropout_prob": cfg.dropout_rate,
        "attention_probs_dropout_prob": cfg.attention_dropout_rate,
        "hidden_act": base.exportable_activation(cfg, what),
        "layer_norm_eps": cfg.norm_epsilon, "max_position_embeddings": cfg.max_length,
        "type_vocab_size": cfg.type_vocab_size, "position_embedding_type": "absolute",
        "pad_token_id": cfg.pad_id, "tie_word_embeddings": True,
    }
    if cfg.num_classes:
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_classes)}
        out["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_classes)}
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    D, N = cfg.d_model, cfg.num_heads
    H = D // N
    p = "" if head(cfg) == "BertModel" else "bert."
    out = [same(f"{p}embeddings.word_embeddings.weight", "embed/embedding"),
           same(f"{p}embeddings.position_embeddings.weight",
                "encoder/embedder/pos_embedding/pos_embedding"),
           same(f"{p}embeddings.token_type_embeddings.weight",
                "encoder/embedder/type_embedding/embedding"),
           *layer_norm(f"{p}embeddings.LayerNorm", "encoder/embedder/embedding_norm")]
    names = {"query": "self.query", "key": "self.key", "value": "self.value",
             "out": "output.dense"}
    for i in range(cfg.num_encoder_layers):
        hf, zoo = f"{p}encoder.layer.{i}", f"encoder/layer_{i}"
        out += attention(f"{hf}.attention", f"{zoo}/self_attention", D, N, H, names)
        out += layer_norm(f"{hf}.attention.output.LayerNorm", f"{zoo}/attention_residual/norm")
        out += linear(f"{hf}.intermediate.dense", f"{zoo}/ffn/wi", (D,), (cfg.d_ff,))
        out += linear(f"{hf}.output.dense", f"{zoo}/ffn/wo", (cfg.d_ff,), (D,))
        out += layer_norm(f"{hf}.output.LayerNorm", f"{zoo}/ffn_residual/norm")
    if cfg.pooler or cfg.num_classes:
        out += linear(f"{p}pooler.dense", "pooler", (D,), (D,))
    if cfg.num_classes:
        out += linear("classifier", "classifier", (D,), (cfg.num_classes,))
    if cfg.mlm_transform:
        out += linear("cls.predictions.transform.dense", "mlm_dense", (D,), (D,))
        out += layer_norm("cls.predictions.transform.LayerNorm", "mlm_norm")
        out.append(same("cls.predictions.bias", "logits_bias"))
    return out


# Buffers and tied copies a BERT file may hold beside the weights.
_DERIVED = ("embeddings.position_ids", "cls.predictions.decoder.weight",
            "cls.predictions.decoder.bias")


def normalise(names: set[str], cfg: ModelConfig) -> dict[str, str]:
    """{exported name: file name}: adds or strips the "bert." prefix, drops buffers."""
    prefixed = head(cfg) != "BertModel"
    out = {}
    for name in names:
        bare = name.removeprefix("bert.")
        if bare in _DERIVED:
            continue
        top = bare.startswith(("cls.", "classifier."))
        out[bare if top or not prefixed else f"bert.{bare}"] = name
    return out


ARCHITECTURE = base.Architecture("bert", Family.ENCODER_ONLY, config_from_hf, config_to_hf,
                                 rules, normalise)

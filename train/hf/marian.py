"""Marian / OPUS-MT (encoder-decoder, the paper's family): MarianMTModel.

Post-norm, sinusoidal positions with the sines in the first half and the
cosines in the second ("sinusoidal_concat"; computed, not stored), embeddings
x sqrt(D) (scale_embedding), SiLU ("swish") FFNs, one embedding shared by
encoder, decoder and the output, a final_logits_bias, and decoding that starts
from the pad id (decoder_start_token_id).
"""

from __future__ import annotations

from collections.abc import Mapping

from transformer_zoo.models import ModelConfig
from transformer_zoo.train.hf import base
from transformer_zoo.train.hf.rules import Rule, attention, layer_norm, linear, same
from transformer_zoo.train.tasks import Family

_ATTENTION = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "out_proj"}
# Computed or tied copies that a Marian file may hold.
_DERIVED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight",
            "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
            "lm_head.weight")


def _same_sides(hf: Mapping, encoder_key: str, decoder_key: str):
    value = base.number(hf, encoder_key)
    if hf.get(decoder_key, value) != value:
        raise base.ConversionError(f"config.json {encoder_key}={value} and {decoder_key}="
                                   f"{hf[decoder_key]} differ; this zoo has one value for both")
    return value


def config_from_hf(hf: Mapping, names: set[str]) -> ModelConfig:
    vocab = base.number(hf, "vocab_size")
    base.require(hf, "share_encoder_decoder_embeddings", (True,), True)
    base.require(hf, "decoder_vocab_size", (vocab, None), vocab)
    base.require(hf, "tie_word_embeddings", (True,), True)
    base.require(hf, "normalize_embedding", (False,), False)
    pad = base.number(hf, "pad_token_id")
    return ModelConfig(
        vocab_size=vocab,
        d_model=base.number(hf, "d_model"),
        num_heads=_same_sides(hf, "encoder_attention_heads", "decoder_attention_heads"),
        d_ff=_same_sides(hf, "encoder_ffn_dim", "decoder_ffn_dim"),
        num_encoder_layers=base.number(hf, "encoder_layers"),
        num_decoder_layers=base.number(hf, "decoder_layers"),
        dropout_rate=hf.get("dropout", 0.1),
        attention_dropout_rate=hf.get("attention_dropout", 0.0),
        activation_dropout_rate=hf.get("activation_dropout", 0.0),
        ffn_activation=base.activation(hf, "activation_function"),
        norm_epsilon=1e-5,  # torch.nn.LayerNorm's default, which Marian uses
        norm_position="post",
        position_encoding="sinusoidal_concat",
        max_length=base.number(hf, "max_position_embeddings"),
        use_bias=True,
        share_embeddings=True,
        tie_output=True,
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        output_bias=True,
        pad_id=pad,
        bos_id=hf.get("decoder_start_token_id", pad),
        eos_id=base.number(hf, "eos_token_id"),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    what = "Marian"
    base.check_exportable(
        cfg, what, norm="layernorm", norm_epsilon=1e-5, norm_position="post",
        position_encoding="sinusoidal_concat", use_bias=True, share_embeddings=True,
        tie_output=True, output_bias=True, embedding_norm=False, type_vocab_size=0,
        num_kv_heads=(None, cfg.num_heads), head_dim=(None, cfg.d_model // cfg.num_heads),
        v_head_dim=None, score_fn="dot", attention_window=None, input_vocab_size=(
            None, cfg.vocab_size), output_ids=None)
    return {
        "model_type": "marian", "architectures": ["MarianMTModel"],
        "vocab_size": cfg.vocab_size, "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_attention_heads": cfg.num_heads, "decoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "encoder_layers": cfg.num_encoder_layers, "decoder_layers": cfg.num_decoder_layers,
        "dropout": cfg.dropout_rate, "attention_dropout": cfg.attention_dropout_rate,
        "activation_dropout": cfg.activation_dropout_rate,
        "activation_function": base.exportable_activation(cfg, what),
        "max_position_embeddings": cfg.max_length, "scale_embedding": cfg.scale_embeddings,
        "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
        "pad_token_id": cfg.pad_id, "decoder_start_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id, "forced_eos_token_id": cfg.eos_id,
        "is_encoder_decoder": True, "static_position_embeddings": True,
        # Never generate <pad> (the decoder start), as OPUS-MT's configs and the zoo.
        "bad_words_ids": [[cfg.pad_id]],
    }


def _block(hf: str, zoo: str, cfg: ModelConfig, cross: bool) -> list[Rule]:
    D, N, F = cfg.d_model, cfg.num_heads, cfg.d_ff
    H = D // N
    out = attention(f"{hf}.self_attn", f"{zoo}/self_attention", D, N, H, _ATTENTION)
    out += layer_norm(f"{hf}.self_attn_layer_norm", f"{zoo}/attention_residual/norm")
    if cross:
        out += attention(f"{hf}.encoder_attn", f"{zoo}/cross_attention", D, N, H, _ATTENTION)
        out += layer_norm(f"{hf}.encoder_attn_layer_norm", f"{zoo}/cross_residual/norm")
    out += linear(f"{hf}.fc1", f"{zoo}/ffn/wi", (D,), (F,))
    out += linear(f"{hf}.fc2", f"{zoo}/ffn/wo", (F,), (D,))
    return out + layer_norm(f"{hf}.final_layer_norm", f"{zoo}/ffn_residual/norm")


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [same("model.shared.weight", "target_embed/embedding"),
           same("final_logits_bias", "decoder/logits_bias", (cfg.vocab_size,),
                (1, cfg.vocab_size))]
    for i in range(cfg.num_encoder_layers):
        out += _block(f"model.encoder.layers.{i}", f"encoder/layer_{i}", cfg, cross=False)
    for i in range(cfg.num_decoder_layers):
        out += _block(f"model.decoder.layers.{i}", f"decoder/layer_{i}", cfg, cross=True)
    return out


def normalise(names: set[str], cfg: ModelConfig) -> dict[str, str]:
    """{exported name: file name}: adds MarianModel's missing "model." prefix, drops copies."""
    out = {}
    for name in names:
        full = name if name.startswith(("model.", "final_logits_bias", "lm_head.")) \
            else f"model.{name}"
        if full not in _DERIVED:
            out[full] = name
    return out


ARCHITECTURE = base.Architecture("marian", Family.ENCODER_DECODER, config_from_hf,
                                 config_to_hf, rules, normalise)

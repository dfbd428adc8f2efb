"""GPT-2 (decoder-only): GPT2Model, GPT2LMHeadModel.

Pre-norm with a final LayerNorm, learned positions, tanh-approximated GELU
("gelu_new"), biases, no sqrt(D) embedding scale, the output tied to the token
embeddings. Its Conv1D layers store weights [in, out], and one c_attn holds
the query, key and value projections side by side.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from transformer_zoo.models import ModelConfig
from transformer_zoo.train.hf import base
from transformer_zoo.train.hf.rules import Rule, fused_qkv, layer_norm, linear, same
from transformer_zoo.train.tasks import Family

# The causal-mask buffers of older files ("h.0.attn.bias", "h.0.attn.masked_bias").
_BUFFER = re.compile(r"h\.\d+\.attn\.(masked_)?bias$")


def config_from_hf(hf: Mapping, names: set[str]) -> ModelConfig:
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        base.require(hf, key, (False,), False)
    base.require(hf, "scale_attn_weights", (True,), True)
    base.require(hf, "tie_word_embeddings", (True,), True)
    d_model = base.number(hf, "n_embd")
    eos = hf.get("eos_token_id", 50256)
    pad = hf.get("pad_token_id")
    return ModelConfig(
        vocab_size=base.number(hf, "vocab_size"),
        d_model=d_model,
        num_heads=base.number(hf, "n_head"),
        d_ff=hf.get("n_inner") or 4 * d_model,
        num_encoder_layers=0,
        num_decoder_layers=base.number(hf, "n_layer"),
        dropout_rate=hf.get("resid_pdrop", 0.1),
        attention_dropout_rate=hf.get("attn_pdrop", 0.1),
        ffn_activation=base.activation(hf, "activation_function"),
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        norm_position="pre",
        position_encoding="learned",
        max_length=base.number(hf, "n_positions"),
        use_bias=True,
        tie_output=True,
        scale_embeddings=False,
        # GPT-2 has no pad token: Hugging Face pads with eos (masks come from lengths).
        pad_id=eos if pad is None else pad,
        bos_id=hf.get("bos_token_id", eos),
        eos_id=eos,
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    what = "GPT-2"
    base.check_exportable(
        cfg, what, norm="layernorm", norm_position="pre", position_encoding="learned",
        use_bias=True, tie_output=True, scale_embeddings=False, embedding_norm=False,
        num_kv_heads=(None, cfg.num_heads), head_dim=(None, cfg.d_model // cfg.num_heads),
        v_head_dim=None, score_fn="dot", attention_window=None, output_bias=False,
        type_vocab_size=0, output_ids=None)
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_head": cfg.num_heads,
        "n_inner": cfg.d_ff, "n_layer": cfg.num_decoder_layers, "n_positions": cfg.max_length,
        "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate,
        "attn_pdrop": cfg.attention_dropout_rate,
        "activation_function": base.exportable_activation(cfg, what),
        "layer_norm_epsilon": cfg.norm_epsilon, "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id, "tie_word_embeddings": True,
    }


def rules(cfg: ModelConfig) -> list[Rule]:
    D, N, F = cfg.d_model, cfg.num_heads, cfg.d_ff
    H = D // N
    p = "transformer."
    out = [same(f"{p}wte.weight", "embed/embedding"),
           same(f"{p}wpe.weight", "decoder/embedder/pos_embedding/pos_embedding")]
    for i in range(cfg.num_decoder_layers):
        hf, zoo = f"{p}h.{i}", f"decoder/layer_{i}"
        out += layer_norm(f"{hf}.ln_1", f"{zoo}/attention_residual/norm")
        out += fused_qkv(f"{hf}.attn.c_attn", f"{zoo}/self_attention", D, N, H)
        out += linear(f"{hf}.attn.c_proj", f"{zoo}/self_attention/out", (N, H), (D,),
                      transposed=False)
        out += layer_norm(f"{hf}.ln_2", f"{zoo}/ffn_residual/norm")
        out += linear(f"{hf}.mlp.c_fc", f"{zoo}/ffn/wi", (D,), (F,), transposed=False)
        out += linear(f"{hf}.mlp.c_proj", f"{zoo}/ffn/wo", (F,), (D,), transposed=False)
    return out + layer_norm(f"{p}ln_f", "decoder/final_norm")


def normalise(names: set[str], cfg: ModelConfig) -> dict[str, str]:
    """{exported name: file name}: adds the "transformer." prefix, drops buffers and lm_head."""
    out = {}
    for name in names:
        bare = name.removeprefix("transformer.")
        if _BUFFER.match(bare) or bare == "lm_head.weight":  # lm_head is tied to wte
            continue
        out[f"transformer.{bare}"] = name
    return out


ARCHITECTURE = base.Architecture("gpt2", Family.DECODER_ONLY, config_from_hf, config_to_hf,
                                 rules, normalise)

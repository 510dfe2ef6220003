"""Conversion between Hugging Face GPT-2 (``GPT2LMHeadModel``) and our ``GPTModel``.

HF stores linear weights as ``Conv1D`` (``[in, out]``) and the fused attention projection
as ``[q | k | v]`` over all heads; we store ``nn.Linear`` layout (``[out, in]``) with the
fused rows grouped per head (``[n, 3, d]``), so each tensor-parallel rank's contiguous slice
holds whole heads. GPT-2 uses the tanh approximation of GeLU.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.config import ModelConfig
from megatron.model.names import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    layer_key,
    refuse_experts,
)


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig with the shape of a ``transformers.GPT2Config``."""
    fields = dict(
        num_layers=hf_config.n_layer,
        hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head,
        ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        seq_length=hf_config.n_positions,
        max_position_embeddings=hf_config.n_positions,
        vocab_size=hf_config.vocab_size,
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        hidden_dropout=hf_config.resid_pdrop,
        attention_dropout=hf_config.attn_pdrop,
        init_method_std=hf_config.initializer_range,
        activation="gelu_tanh" if "new" in hf_config.activation_function
        or "tanh" in hf_config.activation_function else "gelu",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# Per-layer tensors whose names differ but whose values map one to one (Linear <-> Conv1D
# weights are transposed; LayerNorm weights are not). Ours -> HF's, inside one layer.
_LAYER_NAMES = {
    "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2",
    "self_attention.dense": "attn.c_proj", "mlp.dense_h_to_4h": "mlp.c_fc",
    "mlp.dense_4h_to_h": "mlp.c_proj",
}


def _qkv_rows_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[3 * n * d, ...]`` ordered q, k, v -> ordered per head (n, 3, d)."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_rows_per_kind(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of ``_qkv_rows_per_head``."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def hf_to_megatron_state_dict(hf_sd: dict[str, torch.Tensor],
                              config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our single-stage, tensor-parallel-size-1 state dict from a GPT2LMHeadModel's.

    The vocabulary is padded with zero rows up to ``config.padded_vocab_size``.
    """
    sd = {k.removeprefix("transformer."): v for k, v in hf_sd.items()}
    heads = config.num_attention_heads
    wte = sd["wte.weight"]
    pad = config.padded_vocab_size - wte.size(0)
    out = {
        WORD_EMBEDDINGS: torch.cat([wte, wte.new_zeros(pad, wte.size(1))]),
        POSITION_EMBEDDINGS: sd["wpe.weight"],
        FINAL_NORM[0]: sd["ln_f.weight"],
        FINAL_NORM[1]: sd["ln_f.bias"],
    }
    for i in range(config.num_layers):
        src = f"h.{i}."
        for ours, theirs in _LAYER_NAMES.items():
            weight = sd[src + theirs + ".weight"]
            out[layer_key(i, ours + ".weight")] = weight if "layernorm" in ours else weight.t()
            out[layer_key(i, ours + ".bias")] = sd[src + theirs + ".bias"]
        qkv = "self_attention.query_key_value"
        out[layer_key(i, qkv + ".weight")] = _qkv_rows_per_head(
            sd[src + "attn.c_attn.weight"].t(), heads)
        out[layer_key(i, qkv + ".bias")] = _qkv_rows_per_head(sd[src + "attn.c_attn.bias"], heads)
    if config.untie_embeddings_and_output_weights:
        head = hf_sd.get("lm_head.weight", wte)
        out[OUTPUT_LAYER] = torch.cat([head, head.new_zeros(pad, head.size(1))])
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf_state_dict(sd: dict[str, torch.Tensor],
                              config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_to_megatron_state_dict`` (the vocabulary padding is dropped)."""
    heads, vocab = config.num_attention_heads, config.vocab_size
    out = {
        "transformer.wte.weight": sd[WORD_EMBEDDINGS][:vocab],
        "transformer.wpe.weight": sd[POSITION_EMBEDDINGS],
        "transformer.ln_f.weight": sd[FINAL_NORM[0]],
        "transformer.ln_f.bias": sd[FINAL_NORM[1]],
    }
    for i in range(config.num_layers):
        dst = f"transformer.h.{i}."
        for ours, theirs in _LAYER_NAMES.items():
            weight = sd[layer_key(i, ours + ".weight")]
            out[dst + theirs + ".weight"] = weight if "layernorm" in ours else weight.t()
            out[dst + theirs + ".bias"] = sd[layer_key(i, ours + ".bias")]
        qkv = layer_key(i, "self_attention.query_key_value")
        out[dst + "attn.c_attn.weight"] = _qkv_rows_per_kind(sd[qkv + ".weight"], heads).t()
        out[dst + "attn.c_attn.bias"] = _qkv_rows_per_kind(sd[qkv + ".bias"], heads)
    head = sd.get(OUTPUT_LAYER, sd[WORD_EMBEDDINGS])
    out["lm_head.weight"] = head[:vocab]
    return {k: v.contiguous().clone() for k, v in out.items()}


class HfGpt2Adapter:
    """``adapters.StateDictAdapter`` of Hugging Face's GPT2LMHeadModel."""

    name = "hf_gpt2"

    def to_ours(self, state: dict, config: ModelConfig) -> dict:
        refuse_experts(config, "Hugging Face GPT-2")
        return hf_to_megatron_state_dict(state, config)

    def from_ours(self, state: dict, config: ModelConfig) -> dict:
        refuse_experts(config, "Hugging Face GPT-2")
        return megatron_to_hf_state_dict(state, config)


HF_GPT2 = HfGpt2Adapter()

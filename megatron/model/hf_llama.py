"""Hugging Face's Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``) and our GPT with RMSNorm, SwiGLU, grouped-query attention and RoPE:
their configurations and their weights, both ways.

Both sides rotate the two halves of each head (Hugging Face's ``rotate_half``), so query and
key rows need no permutation. Our fused QKV rows are grouped per key/value head: for group
``j`` its ``n/g`` query heads (Hugging Face's query heads ``j*n/g ...``, the ones its
``repeat_kv`` gives key head ``j``), then key head ``j``, then value head ``j``. Our SwiGLU
projection is ``[gate; up]``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.config import ModelConfig
from megatron.model.names import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    layer_key,
    refuse_experts,
)
from megatron.model.rotary import (
    HIGH_FREQ_FACTOR,
    LLAMA3_ORIGINAL_CONTEXT,
    LOW_FREQ_FACTOR,
)

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
# Inside one layer: ours -> Hugging Face's, values one to one.
_SAME = {"input_layernorm.weight": "input_layernorm.weight",
         "post_attention_layernorm.weight": "post_attention_layernorm.weight",
         "self_attention.dense.weight": "self_attn.o_proj.weight",
         "self_attention.dense.bias": "self_attn.o_proj.bias",
         "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
         "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias"}


def _get(hf: Any, name: str, default: Any = None) -> Any:
    return hf.get(name, default) if isinstance(hf, dict) else getattr(hf, name, default)


def _rope_scaling(hf: Any) -> dict:
    """Our RoPE scaling flags from the config's ``rope_scaling`` (transformers 4.x) or
    ``rope_parameters`` (5.x): Llama 3.1's with its own constants, or none."""
    scaling = _get(hf, "rope_scaling") or _get(hf, "rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return {}
    expected = {"low_freq_factor": LOW_FREQ_FACTOR, "high_freq_factor": HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    if kind != "llama3" or any(scaling.get(k, v) != v for k, v in expected.items()):
        raise ValueError(f"rope_scaling {scaling}: only Llama 3.1's (rope_type llama3, "
                         f"{expected}) is supported")
    return {"use_rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def _rope_theta(hf: Any) -> float:
    params = _get(hf, "rope_parameters") or {}
    return params.get("rope_theta", _get(hf, "rope_theta", 10000.0))


def model_config_from_hf_llama(hf: Any, **overrides: Any) -> ModelConfig:
    """Our ``ModelConfig`` of a Llama, Mistral or Qwen2 config (object or ``config.json``
    dict). ``overrides``: fields to set as well (sequence length, parallel sizes)."""
    model_type = _get(hf, "model_type", "llama")
    heads = _get(hf, "num_attention_heads")
    hidden = _get(hf, "hidden_size")
    window = _get(hf, "sliding_window") if _get(hf, "use_sliding_window", True) else None
    if model_type != "qwen2" and window is not None and window < _get(
            hf, "max_position_embeddings"):
        raise ValueError(f"sliding-window attention ({window} positions) is not supported")
    attention_bias = bool(_get(hf, "attention_bias", False))
    if model_type != "qwen2" and attention_bias != bool(_get(hf, "mlp_bias", False)):
        raise ValueError("attention_bias and mlp_bias differ: biases on some linear layers "
                         "only are not supported (only Qwen2's on the QKV projection)")
    fields = dict(
        num_layers=_get(hf, "num_hidden_layers"), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=_get(hf, "num_key_value_heads") or heads,
        kv_channels=_get(hf, "head_dim") or hidden // heads,
        ffn_hidden_size=_get(hf, "intermediate_size"), swiglu=True,
        normalization="RMSNorm", layernorm_epsilon=_get(hf, "rms_norm_eps"),
        position_embedding_type="rope", rotary_base=int(_rope_theta(hf)),
        max_position_embeddings=_get(hf, "max_position_embeddings"),
        seq_length=min(_get(hf, "max_position_embeddings"), 4096),
        vocab_size=_get(hf, "vocab_size"),
        untie_embeddings_and_output_weights=not _get(hf, "tie_word_embeddings", False),
        add_bias_linear=attention_bias and model_type != "qwen2",
        add_qkv_bias=model_type == "qwen2", hidden_dropout=0.0,
        attention_dropout=float(_get(hf, "attention_dropout", 0.0) or 0.0),
        init_method_std=_get(hf, "initializer_range", 0.02), **_rope_scaling(hf))
    fields.update(overrides)
    return ModelConfig(**fields)


def _qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              config: ModelConfig) -> torch.Tensor:
    """Hugging Face's q, k, v projections (rows ``[n d]``, ``[g d]``, ``[g d]``) as our
    fused rows ``[g, n/g + 2, d]``."""
    g, d = config.query_groups, config.kv_channels
    rest = q.shape[1:]
    q = q.reshape(g, -1, d, *rest)  # [g, n/g, d, ...]
    k, v = k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Inverse of ``_qkv_rows``."""
    g, d = config.query_groups, config.kv_channels
    rest = fused.shape[1:]
    grouped = fused.reshape(g, -1, d, *rest)  # [g, n/g + 2, d, ...]
    q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


def hf_llama_to_megatron_state_dict(hf_sd: dict[str, torch.Tensor],
                                    config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our single-stage, tensor-parallel-size-1 state dict from a Llama-family model's; the
    vocabulary padded with zero rows up to ``config.padded_vocab_size``."""
    sd = {k.removeprefix("model."): v for k, v in hf_sd.items()}
    rows = config.padded_vocab_size
    out = {WORD_EMBEDDINGS: _pad_rows(sd["embed_tokens.weight"], rows),
           FINAL_NORM[0]: sd["norm.weight"]}
    for i in range(config.num_layers):
        src = f"layers.{i}."
        for ours, theirs in _SAME.items():
            if src + theirs in sd:
                out[layer_key(i, ours)] = sd[src + theirs]
        for kind in ("weight", "bias"):
            q = sd.get(f"{src}self_attn.q_proj.{kind}")
            if q is not None:
                k, v = sd[f"{src}self_attn.k_proj.{kind}"], sd[f"{src}self_attn.v_proj.{kind}"]
                out[layer_key(i, f"self_attention.query_key_value.{kind}")] = _qkv_rows(
                    q, k, v, config)
            gate = sd.get(f"{src}mlp.gate_proj.{kind}")
            if gate is not None:
                out[layer_key(i, f"mlp.dense_h_to_4h.{kind}")] = torch.cat(
                    [gate, sd[f"{src}mlp.up_proj.{kind}"]])
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = _pad_rows(hf_sd.get("lm_head.weight", sd["embed_tokens.weight"]),
                                      rows)
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf_llama_state_dict(sd: dict[str, torch.Tensor],
                                    config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_llama_to_megatron_state_dict`` (the vocabulary padding dropped)."""
    vocab = config.vocab_size
    out = {"model.embed_tokens.weight": sd[WORD_EMBEDDINGS][:vocab],
           "model.norm.weight": sd[FINAL_NORM[0]]}
    for i in range(config.num_layers):
        dst = f"model.layers.{i}."
        for ours, theirs in _SAME.items():
            if layer_key(i, ours) in sd:
                out[dst + theirs] = sd[layer_key(i, ours)]
        for kind in ("weight", "bias"):
            fused = sd.get(layer_key(i, f"self_attention.query_key_value.{kind}"))
            if fused is not None:
                q, k, v = _split_qkv(fused, config)
                out.update({f"{dst}self_attn.{p}_proj.{kind}": t
                            for p, t in zip("qkv", (q, k, v))})
            fc1 = sd.get(layer_key(i, f"mlp.dense_h_to_4h.{kind}"))
            if fc1 is not None:
                gate, up = fc1.chunk(2)
                out[f"{dst}mlp.gate_proj.{kind}"], out[f"{dst}mlp.up_proj.{kind}"] = gate, up
    head = sd.get(OUTPUT_LAYER, sd[WORD_EMBEDDINGS])
    out["lm_head.weight"] = head[:vocab]
    return {k: v.contiguous().clone() for k, v in out.items()}


class HfLlamaAdapter:
    """``adapters.StateDictAdapter`` of Hugging Face's Llama family (Llama, Mistral, Qwen2:
    the same weight names)."""

    name = "hf_llama"

    def to_ours(self, state: dict, config: ModelConfig) -> dict:
        refuse_experts(config, "Hugging Face Llama")
        return hf_llama_to_megatron_state_dict(state, config)

    def from_ours(self, state: dict, config: ModelConfig) -> dict:
        refuse_experts(config, "Hugging Face Llama")
        return megatron_to_hf_llama_state_dict(state, config)


HF_LLAMA = HfLlamaAdapter()

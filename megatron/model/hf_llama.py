"""Hugging Face's Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, and the mixtures of experts ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM``) and our GPT with RMSNorm, SwiGLU, grouped-query attention and RoPE:
their configurations and their weights, both ways.

Both sides rotate the two halves of each head (Hugging Face's ``rotate_half``), so query and
key rows need no permutation. Our fused QKV rows are grouped per key/value head: for group
``j`` its ``n/g`` query heads (Hugging Face's query heads ``j*n/g ...``, the ones its
``repeat_kv`` gives key head ``j``), then key head ``j``, then value head ``j``. Our SwiGLU
projection is ``[gate; up]``.

Mixtures of experts: each expert, and Qwen2-MoE's shared expert, is an MLP mapped as the
dense one is (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral's files call them ``w1``,
``w3``, ``w2`` under ``block_sparse_moe``), expert ``J`` to our ``mlp.local_experts.J``; the
router ``mlp.gate`` is our ``mlp.router``, Qwen2-MoE's ``shared_expert_gate`` our
``mlp.shared_experts.gate_weight`` (``--moe-shared-expert-gate``). transformers 5 holds a
layer's experts fused in memory (``experts.gate_up_proj`` ``[E, 2f, h]``, ``experts.down_proj``
``[E, h, f]``) and writes them per expert; both forms are read, and ``fit_to_model`` gives a
model the form it holds. Routing: Mixtral's (softmax over all experts, top k, renormalised)
is the softmax over the top-k logits, our default; Qwen2-MoE's without ``norm_topk_prob`` is
``--moe-router-pre-softmax``. Its ``decoder_sparse_step`` and ``mlp_only_layers`` become a
``--moe-layer-freq`` list. ``router_aux_loss_coef`` is ``--moe-aux-loss-coeff`` (Hugging Face
trains with it only under ``output_router_logits``, written as whether the coefficient is
used; its loss pools the layers' tokens and is k times Megatron's per-layer one, so the two
weigh balancing alike, not identically).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron.config import ModelConfig
from megatron.model.names import (
    FINAL_NORM,
    OUTPUT_LAYER,
    ROUTER,
    SHARED_EXPERT_GATE,
    WORD_EMBEDDINGS,
    layer_key,
)
from megatron.model.rotary import (
    HIGH_FREQ_FACTOR,
    LLAMA3_ORIGINAL_CONTEXT,
    LOW_FREQ_FACTOR,
)

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
MOE_TYPES = ("mixtral", "qwen2_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}
# Inside one layer: ours -> Hugging Face's, values one to one.
_SAME = {"input_layernorm.weight": "input_layernorm.weight",
         "post_attention_layernorm.weight": "post_attention_layernorm.weight",
         "self_attention.dense.weight": "self_attn.o_proj.weight",
         "self_attention.dense.bias": "self_attn.o_proj.bias",
         ROUTER: "mlp.gate.weight",
         SHARED_EXPERT_GATE: "mlp.shared_expert_gate.weight"}
# Mixtral's stored names of an expert's projections (under ``block_sparse_moe.``, not
# ``mlp.``), and the fused ones transformers 5 holds in memory.
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_MIXTRAL_KEY = re.compile(r"(.*)\.block_sparse_moe\.(gate|experts\.\d+\.(w[123]))\.weight")
_FUSED_KEY = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


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
    """Our ``ModelConfig`` of a Llama, Mistral, Qwen2, Mixtral or Qwen2-MoE config (object or
    ``config.json`` dict). ``overrides``: fields to set as well (sequence length, parallel
    sizes). What our GPT cannot compute is a ``ValueError`` naming the config field."""
    model_type = _get(hf, "model_type", "llama")
    heads = _get(hf, "num_attention_heads")
    hidden = _get(hf, "hidden_size")
    _refuse_sliding_window(hf, model_type)
    act = _get(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r}: the SwiGLU MLP here gates with SiLU")
    qwen = model_type in ("qwen2", "qwen2_moe")
    attention_bias = bool(_get(hf, "attention_bias", False))
    if not qwen and attention_bias != bool(_get(hf, "mlp_bias", False)):
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
        add_bias_linear=attention_bias and not qwen,
        add_qkv_bias=qwen and bool(_get(hf, "qkv_bias", True)), hidden_dropout=0.0,
        attention_dropout=float(_get(hf, "attention_dropout", 0.0) or 0.0),
        init_method_std=_get(hf, "initializer_range", 0.02), **_rope_scaling(hf))
    if model_type in MOE_TYPES:
        fields.update(_moe_fields(hf, model_type))
    fields.update(overrides)
    return ModelConfig(**fields)


def _refuse_sliding_window(hf: Any, model_type: str) -> None:
    """Sliding-window attention, which this framework does not have, unless the window spans
    every position. Qwen2's window applies only to the layers its ``layer_types`` (or, before
    transformers 5, ``use_sliding_window``) name."""
    window = _get(hf, "sliding_window")
    if model_type in ("qwen2", "qwen2_moe"):
        types = _get(hf, "layer_types")
        used = ("sliding_attention" in types) if types is not None else \
            bool(_get(hf, "use_sliding_window", False))
        window = window if used else None
    if window and window < _get(hf, "max_position_embeddings"):
        raise ValueError(f"sliding_window {window}: sliding-window attention is not supported "
                         "(every layer here attends over the whole sequence)")


def _moe_fields(hf: Any, model_type: str) -> dict:
    """Our mixture-of-experts fields of a Mixtral or Qwen2-MoE config."""
    fields = dict(moe_router_topk=_get(hf, "num_experts_per_tok"),
                  moe_aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 0.0) or 0.0))
    if model_type == "mixtral":
        jitter = _get(hf, "router_jitter_noise", 0.0)
        if jitter:
            raise ValueError(f"router_jitter_noise {jitter}: the router here scales no input "
                             "by random noise in training")
        return dict(fields, num_experts=_get(hf, "num_local_experts"))
    return dict(fields, num_experts=_get(hf, "num_experts"),
                moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
                moe_shared_expert_intermediate_size=_get(hf, "shared_expert_intermediate_size"),
                moe_shared_expert_gate=True,
                moe_router_pre_softmax=not _get(hf, "norm_topk_prob", False),
                moe_layer_freq=_qwen2_moe_layer_freq(hf))


def _qwen2_moe_layer_freq(hf: Any) -> str:
    """Qwen2-MoE's sparse layers (every ``decoder_sparse_step``-th counted from 1, less the
    ``mlp_only_layers``) as ``--moe-layer-freq``: ``"1"`` when all are, else the list."""
    step, dense = _get(hf, "decoder_sparse_step", 1), set(_get(hf, "mlp_only_layers") or ())
    experts = _get(hf, "num_experts") or 0
    sparse = [int(experts > 0 and i not in dense and (i + 1) % step == 0)
              for i in range(_get(hf, "num_hidden_layers"))]
    if not any(sparse):
        raise ValueError(f"num_experts {experts}, decoder_sparse_step {step} and "
                         f"mlp_only_layers {sorted(dense)} leave no layer with experts: a "
                         "dense model (convert it as Qwen2ForCausalLM)")
    return "1" if all(sparse) else "[" + ",".join(map(str, sparse)) + "]"


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


def _mlp_prefixes(config: ModelConfig, layer: int) -> list[tuple[str, str]]:
    """(ours, theirs) prefixes of each MLP in a layer: the dense one, or each expert's and
    the shared expert's."""
    if not config.moe_layers[layer]:
        return [("mlp.", "mlp.")]
    pairs = [(f"mlp.local_experts.{j}.", f"mlp.experts.{j}.")
             for j in range(config.num_experts)]
    if config.moe_shared_expert_intermediate_size is not None:
        pairs.append(("mlp.shared_experts.", "mlp.shared_expert."))
    return pairs


def hf_llama_to_megatron_state_dict(hf_sd: dict[str, torch.Tensor],
                                    config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our single-stage, tensor-parallel-size-1 state dict from a Llama-family model's (its
    experts stored or fused); the vocabulary padded with zero rows up to
    ``config.padded_vocab_size``."""
    sd = {k.removeprefix("model."): v for k, v in _plain_expert_names(hf_sd).items()}
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
            for ours, theirs in _mlp_prefixes(config, i):
                gate = sd.get(f"{src}{theirs}gate_proj.{kind}")
                if gate is not None:
                    out[layer_key(i, f"{ours}dense_h_to_4h.{kind}")] = torch.cat(
                        [gate, sd[f"{src}{theirs}up_proj.{kind}"]])
                    out[layer_key(i, f"{ours}dense_4h_to_h.{kind}")] = \
                        sd[f"{src}{theirs}down_proj.{kind}"]
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = _pad_rows(hf_sd.get("lm_head.weight", sd["embed_tokens.weight"]),
                                      rows)
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf_llama_state_dict(sd: dict[str, torch.Tensor],
                                    config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_llama_to_megatron_state_dict`` (the vocabulary padding dropped),
    experts under the names their files keep: Qwen2-MoE's ``mlp.experts.J.gate_proj``, or
    for a model without a shared expert (a Mixtral) ``block_sparse_moe.experts.J.w1``."""
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
            for ours, theirs in _mlp_prefixes(config, i):
                fc1 = sd.get(layer_key(i, f"{ours}dense_h_to_4h.{kind}"))
                if fc1 is not None:
                    out[f"{dst}{theirs}gate_proj.{kind}"], out[f"{dst}{theirs}up_proj.{kind}"] \
                        = fc1.chunk(2)
                    out[f"{dst}{theirs}down_proj.{kind}"] = \
                        sd[layer_key(i, f"{ours}dense_4h_to_h.{kind}")]
    head = sd.get(OUTPUT_LAYER, sd[WORD_EMBEDDINGS])
    out["lm_head.weight"] = head[:vocab]
    if config.num_experts is not None and config.moe_shared_expert_intermediate_size is None:
        out = _mixtral_names(out)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _plain_expert_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with its experts under Qwen2-MoE's stored names (``mlp.gate``,
    ``mlp.experts.J.gate_proj`` ...): Mixtral's ``block_sparse_moe`` names renamed, and
    transformers 5's fused ``experts.gate_up_proj`` ``[E, 2f, h]`` / ``experts.down_proj``
    ``[E, h, f]`` cut per expert (the first f rows of each ``gate_up_proj`` are the gate)."""
    proj = {v: k for k, v in _MIXTRAL_PROJ.items()}
    out = {}
    for key, value in sd.items():
        m, fused = _MIXTRAL_KEY.fullmatch(key), _FUSED_KEY.fullmatch(key)
        if m is not None:
            name = "gate" if m.group(3) is None else m.group(2)[:-2] + proj[m.group(3)]
            out[f"{m.group(1)}.mlp.{name}.weight"] = value
        elif fused is not None:
            prefix, kind = fused.groups()
            for j, expert in enumerate(value):
                if kind == "down_proj":
                    out[f"{prefix}.{j}.down_proj.weight"] = expert
                else:
                    gate, up = expert.chunk(2)
                    out[f"{prefix}.{j}.gate_proj.weight"] = gate
                    out[f"{prefix}.{j}.up_proj.weight"] = up
        else:
            out[key] = value
    return out


def _mixtral_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``_plain_expert_names``' renaming of Mixtral's keys."""
    expert = re.compile(r"(.*)\.mlp\.(gate|experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight")
    out = {}
    for key, value in sd.items():
        m = expert.fullmatch(key)
        if m is None:
            out[key] = value
            continue
        name = "gate" if m.group(3) is None else \
            m.group(2).removesuffix(m.group(3)) + _MIXTRAL_PROJ[m.group(3)]
        out[f"{m.group(1)}.block_sparse_moe.{name}.weight"] = value
    return out


def fit_to_model(sd: dict[str, torch.Tensor], model_keys) -> dict[str, torch.Tensor]:
    """``sd`` (``megatron_to_hf_llama_state_dict``'s, experts as files keep them) under the
    names of a model whose ``state_dict()`` has ``model_keys``: transformers 5 fuses each
    layer's experts (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), earlier
    versions hold them as the files do."""
    if not any(_FUSED_KEY.fullmatch(k) for k in model_keys):
        return sd
    per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    out, experts = {}, {}
    for key, value in _plain_expert_names(sd).items():
        m = per_expert.fullmatch(key)
        if m is None:
            out[key] = value
        else:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
    for prefix, parts in experts.items():
        count = 1 + max(j for j, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(j, "gate_proj")], parts[(j, "up_proj")]]) for j in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(j, "down_proj")]
                                                  for j in range(count)])
    return out


class HfLlamaAdapter:
    """``adapters.StateDictAdapter`` of Hugging Face's Llama family (Llama, Mistral, Qwen2,
    Mixtral, Qwen2-MoE: the same weight names, experts as their files name them)."""

    name = "hf_llama"

    def to_ours(self, state: dict, config: ModelConfig) -> dict:
        return hf_llama_to_megatron_state_dict(state, config)

    def from_ours(self, state: dict, config: ModelConfig) -> dict:
        return megatron_to_hf_llama_state_dict(state, config)


HF_LLAMA = HfLlamaAdapter()

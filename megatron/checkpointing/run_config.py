"""The run configuration a checkpoint stores, read as ours.

Ours is nested slices (``{"model": {...}, "parallel": {...}, ...}``); Megatron-LM's and
Megatron-DeepSpeed's is their flat argparse fields, mapped here to our model and tokenizer
fields (``model_fields_from_args``), refusing by name the settings our GPT cannot compute.
Loading, conversion, inference and ``--use-checkpoint-args`` read configurations through
this module; ``with_layout`` rewrites one for another tensor/pipeline layout.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.folder import CheckpointFolder


def model_fields_from_args(args: dict, true_vocab_size: Any = None) -> dict:
    """Our ModelConfig fields from Megatron-DeepSpeed's or Megatron-LM's flags
    (``vars(args)``). Raises ``ValueError`` naming a setting our GPT does not have."""
    check_supported_args(args)
    fields = {k: args[k] for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
        "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
        "layernorm_epsilon", "hidden_dropout", "attention_dropout", "init_method_std",
        "untie_embeddings_and_output_weights", "fp16", "bf16", "rotary_percent",
        "rotary_base") if args.get(k) is not None}
    if args.get("norm_epsilon") is not None:  # Megatron-LM's name since 2023
        fields["layernorm_epsilon"] = args["norm_epsilon"]
    fields["vocab_size"] = true_vocab_size or args.get("true_vocab_size") or \
        args.get("padded_vocab_size")
    if args.get("position_embedding_type") in ("learned_absolute", "rope"):
        fields["position_embedding_type"] = args["position_embedding_type"]
    if args.get("use_rotary_position_embeddings"):  # Megatron-DeepSpeed's spelling
        fields["position_embedding_type"] = "rope"
    if args.get("rope_theta") is not None and args.get("rotary_base") is None:
        fields["rotary_base"] = args["rope_theta"]
    if args.get("add_bias_linear") is False:
        fields["add_bias_linear"] = False
    fields.update(_llama_fields(args))
    fields.update(_moe_fields(args))
    fields["activation"] = "gelu_tanh" if gelu_is_tanh(args) else "gelu"
    return fields


def _one(value: Any) -> Any:
    """Megatron-LM keeps some MoE settings as a list (one per loss kind): one of them."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"the checkpoint's model combines {list(value)}, which this "
                             "framework's mixture-of-experts layer does not")
        return value[0]
    return value


def _moe_fields(args: dict) -> dict:
    """Megatron-LM's mixture-of-experts settings (megatron-core's MoELayer) as ours; none for
    a dense model. ``--moe-layer-freq`` is kept as a number or the per-layer list."""
    experts = args.get("num_experts")
    if not isinstance(experts, int) or experts <= 1:
        return {}
    fields = {"num_experts": experts}
    for name in ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy",
                 "moe_router_score_function", "moe_router_bias_update_rate"):
        if args.get(name) is not None:
            fields[name] = args[name]
    for name in ("moe_shared_expert_gate", "moe_router_pre_softmax",
                 "moe_pad_expert_input_to_capacity", "moe_router_enable_expert_bias"):
        if args.get(name):
            fields[name] = True
    freq = args.get("moe_layer_freq")
    if freq is not None:
        fields["moe_layer_freq"] = str(freq).replace(" ", "")
    if args.get("moe_router_load_balancing_type") is not None:
        fields["moe_router_load_balancing_type"] = _one(args["moe_router_load_balancing_type"])
    if args.get("moe_aux_loss_coeff") is not None:
        fields["moe_aux_loss_coeff"] = float(_one(args["moe_aux_loss_coeff"]))
    # The dispatcher moves tokens; every kind of theirs computes what one of ours does.
    dispatcher = args.get("moe_token_dispatcher_type")
    fields["moe_token_dispatcher_type"] = "allgather" if dispatcher == "allgather" else "alltoall"
    return fields


def _llama_fields(args: dict) -> dict:
    """The Llama family's settings among their flags: RMSNorm, SwiGLU, grouped-query
    attention (Megatron-LM's --group-query-attention --num-query-groups, Megatron-DeepSpeed's
    --num-key-value-heads), QKV biases alone, rotation of adjacent pairs, Llama 3.1 scaling."""
    fields: dict = {}
    if str(args.get("normalization") or "LayerNorm").lower() == "rmsnorm":
        fields["normalization"] = "RMSNorm"
    if args.get("swiglu"):
        fields["swiglu"] = True
    heads = args.get("num_attention_heads")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    groups = args.get("num_key_value_heads") or groups
    if groups and groups != heads:
        fields.update(group_query_attention=True, num_query_groups=groups)
    for name in ("add_qkv_bias", "rotary_interleaved", "use_rope_scaling"):
        if args.get(name):
            fields[name] = True
    if args.get("use_rope_scaling") and args.get("rope_scaling_factor") is not None:
        fields["rope_scaling_factor"] = args["rope_scaling_factor"]
    return fields


def gelu_is_tanh(args: dict) -> bool:
    """Whether their MLP computed GeLU's tanh form: ``--openai-gelu``, or the fused bias-GeLU
    kernel (``bias_gelu_fusion``, on by default; it needs the linear biases), which is the
    tanh approximation. Their plain path (``--no-bias-gelu-fusion``) is torch's erf GeLU."""
    if args.get("openai_gelu"):
        return True
    return bool(args.get("bias_gelu_fusion")) and args.get("add_bias_linear") is not False


# Settings of theirs that change the model's computation in a way our GPT cannot: (flag,
# test on vars(args)).
_UNSUPPORTED = (
    # Megatron-DeepSpeed's --num-experts is a list (DeepSpeed-MoE's names are not read here)
    ("--num-experts", lambda a: isinstance(a.get("num_experts"), (list, tuple))
     and max(a["num_experts"], default=1) > 1),
    ("--moe-router-topk-scaling-factor",
     lambda a: a.get("moe_router_topk_scaling_factor") not in (None, 1, 1.0)),
    ("--moe-router-num-groups", lambda a: a.get("moe_router_num_groups")),
    ("--moe-use-legacy-grouped-gemm",
     lambda a: a.get("moe_grouped_gemm") and a.get("moe_use_legacy_grouped_gemm")),
    ("--moe-apply-probs-on-input", lambda a: a.get("moe_apply_probs_on_input")),
    ("--moe-router-load-balancing-type sinkhorn",
     lambda a: "sinkhorn" in str(a.get("moe_router_load_balancing_type"))),
    ("--qk-layernorm", lambda a: a.get("qk_layernorm")),
    ("--apply-layernorm-1p", lambda a: a.get("apply_layernorm_1p")),
    ("--squared-relu", lambda a: a.get("squared_relu")),
    ("--multi-latent-attention", lambda a: a.get("multi_latent_attention")),
)


def check_supported_args(args: dict) -> None:
    """Raise ``ValueError`` naming each of their settings our GPT cannot compute."""
    found = [flag for flag, test in _UNSUPPORTED if test(args)]
    if found:
        raise ValueError(f"the checkpoint's model was trained with {', '.join(found)}, which "
                         "this framework's GPT (GPT-2/3 and the Llama family) does not have")


def is_our_config(saved: Any) -> bool:
    """Whether a stored run configuration is ours (nested slices), not Megatron's flat
    argparse fields."""
    return isinstance(saved, dict) and isinstance(saved.get("model"), dict)


def stored_run_config(folder: CheckpointFolder) -> dict:
    """The run configuration stored with ``folder`` (any format) as ours, Megatron's flags
    mapped to our model and tokenizer fields at tensor/pipeline size 1; a ``CheckpointError``
    when it stores none."""
    saved = folder.config()
    return config_from_stored(saved, not is_our_config(saved), None, folder.path)


def config_from_stored(saved: Optional[dict], theirs: bool, true_vocab_size: Optional[int],
                       where: str) -> dict:
    """``source_config`` of a stored configuration (ours, or Megatron's flat argparse fields)
    already read from a file or a manifest."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} stores no run configuration (no 'config' or 'args')")
    if not theirs and is_our_config(saved):
        config = copy.deepcopy(saved)
    else:
        config = {"model": model_fields_from_args(saved, true_vocab_size),
                  "data": {k: saved.get(k) for k in ("tokenizer_type", "vocab_file",
                                                     "merge_file")}}
    return with_layout(config, 1, 1)


def with_layout(config: dict, tp: int, pp: int, layers_per_virtual_stage: Optional[int] = None,
                distributed_optimizer: Optional[bool] = None) -> dict:
    """``config`` (a copy) describing the (tp, pp, virtual) layout."""
    config = copy.deepcopy(config)
    model = config.setdefault("model", {})
    num_layers = model.get("num_layers")
    vp = None
    if layers_per_virtual_stage and num_layers:  # checked to divide by _target_chunks
        vp = num_layers // pp // layers_per_virtual_stage
    parallel = config.setdefault("parallel", {})
    parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    world_size=tp * pp, decoder_first_pipeline_num_layers=None,
                    decoder_last_pipeline_num_layers=None,
                    num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage if vp and vp > 1
                    else None, virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
                    sequence_parallel=bool(parallel.get("sequence_parallel")) and tp > 1)
    model.update(tensor_model_parallel_size=tp, sequence_parallel=parallel["sequence_parallel"])
    if distributed_optimizer is not None:
        config.setdefault("optimizer", {})["use_distributed_optimizer"] = distributed_optimizer
    return config

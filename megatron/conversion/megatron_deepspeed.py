"""Megatron-DeepSpeed's (and Megatron-LM's legacy) GPT checkpoint layout, read into ours.

Their ``model_optim_rng.pt`` (same folders and tracker as ours) holds the model as nested
dicts::

    model["language_model"]["embedding"]["word_embeddings"]["weight"]
    model["language_model"]["embedding"]["position_embeddings"]["weight"]
    model["language_model"]["encoder"]["layers.{i}.self_attention.query_key_value.weight"]
    model["language_model"]["encoder"]["final_layernorm.weight"]
    model["language_model"]["output_layer"]["weight"]          (untied embeddings)
    model["word_embeddings_for_head"]["weight"]                (last stage, tied, pp > 1)

(``transformer`` instead of ``encoder`` and ``attention`` instead of ``self_attention`` in
older saves), and the run's flags as an argparse Namespace under ``args``. From
``checkpoint_version`` 3.0 on, their fused QKV rows are ordered per head, as ours are.
"""

from __future__ import annotations

from typing import Any

_PREFIXES = (
    ("language_model.embedding.", "embedding."),
    ("language_model.encoder.final_layernorm.", "final_layernorm."),
    ("language_model.transformer.final_layernorm.", "final_layernorm."),
    ("language_model.encoder.layers.", "encoder.layers."),
    ("language_model.transformer.layers.", "encoder.layers."),
    ("language_model.output_layer.", "output_layer."),
    ("word_embeddings_for_head.", "word_embeddings."),
)


def is_megatron_deepspeed_model(model_state: dict) -> bool:
    return "language_model" in model_state


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def our_names(model_state: dict) -> dict:
    """A Megatron-DeepSpeed model chunk's state under our chunk names."""
    out = {}
    for name, value in _flatten(model_state).items():
        for theirs, ours in _PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        else:
            raise ValueError(f"unknown Megatron-DeepSpeed model entry {name!r}")
        out[name.replace(".attention.", ".self_attention.")] = value
    return out


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
    if args.get("add_bias_linear") is False:
        fields["add_bias_linear"] = False
    fields["activation"] = "gelu_tanh" if gelu_is_tanh(args) else "gelu"
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
    ("--swiglu", lambda a: a.get("swiglu")),
    ("--group-query-attention", lambda a: a.get("group_query_attention")
     and a.get("num_query_groups") not in (None, a.get("num_attention_heads"))),
    ("--normalization RMSNorm", lambda a: a.get("normalization", "LayerNorm") != "LayerNorm"),
    ("--num-experts", lambda a: (a.get("num_experts") or 0) > 1),
    ("--qk-layernorm", lambda a: a.get("qk_layernorm")),
    ("--apply-layernorm-1p", lambda a: a.get("apply_layernorm_1p")),
    ("--rotary-interleaved", lambda a: a.get("rotary_interleaved")),
    ("--add-qkv-bias without linear biases", lambda a: a.get("add_qkv_bias")
     and a.get("add_bias_linear") is False),
    ("--squared-relu", lambda a: a.get("squared_relu")),
    ("--multi-latent-attention", lambda a: a.get("multi_latent_attention")),
)


def check_supported_args(args: dict) -> None:
    """Raise ``ValueError`` naming each of their settings our GPT cannot compute."""
    found = [flag for flag, test in _UNSUPPORTED if test(args)]
    if found:
        raise ValueError(f"the checkpoint's model was trained with {', '.join(found)}, which "
                         "this framework's GPT (LayerNorm, GeLU MLP, multi-head attention) "
                         "does not have")

"""Hugging Face folders to and from a ``FullCheckpoint``: GPT-2 (``GPT2LMHeadModel``) and
the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, and the
mixtures of experts ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``).

Reading takes a local folder with ``config.json`` and ``model.safetensors`` or
``pytorch_model.bin`` (nothing is downloaded). Writing produces ``config.json`` and
``model.safetensors`` that ``from_pretrained`` loads, with the vocabulary padding removed,
and GPT-2's tokenizer files (``vocab.json``, ``merges.txt``) copied when they are known. The
weight mappings themselves are ``megatron/model/hf_gpt2.py``'s and ``hf_llama.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from typing import Optional

import torch

from megatron.checkpointing.full_state import FullCheckpoint
from megatron.checkpointing.run_config import with_layout
from megatron.config import to_dict
from megatron.conversion.full import save_full_checkpoint
from megatron.model import hf_llama
from megatron.model.hf_gpt2 import (
    HF_GPT2,
    model_config_from_hf,
)

MODEL_TYPES = ("gpt2", *hf_llama.MODEL_TYPES)

# What from_pretrained reads, in its order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ConversionError(Exception):
    """The input cannot be converted; the message names the flag or the file."""


def read_hf_config(hf_model_dir: str, flag: str = "--hf-model-dir") -> dict:
    """``config.json`` of the folder, checked to be JSON describing a GPT-2."""
    if not os.path.isdir(hf_model_dir):
        raise ConversionError(f"{flag} {hf_model_dir!r} is not a folder")
    path = os.path.join(hf_model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{flag} {hf_model_dir!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} must hold a JSON object, not {type(config).__name__}")
    if config.get("model_type", "gpt2") not in MODEL_TYPES:
        raise ConversionError(f"{path}: model_type {config['model_type']!r}; this tool "
                              f"converts {', '.join(repr(t) for t in MODEL_TYPES)}")
    return config


def find_weights(hf_model_dir: str, flag: str = "--hf-model-dir") -> str:
    """The weights file from_pretrained will read."""
    for name in WEIGHT_FILES:
        path = os.path.join(hf_model_dir, name)
        if os.path.isfile(path):
            return path
    raise ConversionError(f"{flag} {hf_model_dir!r} holds no weights: none of "
                          f"{', '.join(WEIGHT_FILES)}")


def check_weights_file(path: str) -> None:
    """A quick look at the container before torch or safetensors parse it, so a corrupt file
    is named as such (their own errors suggest unsafe loading, or say nothing of the file)."""
    if path.endswith(".index.json"):
        return  # the shards it lists are checked by from_pretrained
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt"):
                return
        except Exception as e:  # SafetensorError is not importable under one stable name
            raise ConversionError(f"{path} is not a readable safetensors file (truncated or "
                                  f"corrupt?): {e}") from None
    with open(path, "rb") as f:
        head = f.read(2)
    # torch.save writes a zip archive; before PyTorch 1.6 a pickle (protocol 2: 0x80 0x02).
    if not zipfile.is_zipfile(path) and head != b"\x80\x02":
        raise ConversionError(f"{path} is not a PyTorch weights file (neither a complete zip "
                              "archive nor a pickle): truncated or corrupt?")


def load_hf_model(hf_model_dir: str, flag: str = "--hf-model-dir"):
    """The model of the folder (GPT2LMHeadModel, or the Llama family's by its model_type);
    unreadable files raise ConversionError naming them."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one model's load needs none, and errors stay readable
    model_type = read_hf_config(hf_model_dir, flag).get("model_type", "gpt2")
    weights = find_weights(hf_model_dir, flag)
    check_weights_file(weights)
    name = hf_llama.ARCHITECTURES.get(model_type, "GPT2LMHeadModel")
    try:
        return getattr(transformers, name).from_pretrained(hf_model_dir, local_files_only=True)
    except Exception as e:  # safetensors, torch's unpickler and transformers each raise their own
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConversionError(f"cannot load the model from {weights} (with "
                              f"{os.path.join(hf_model_dir, 'config.json')}): "
                              f"{type(e).__name__}: {reason}") from e


def load_hf_checkpoint(hf_model_dir: str, make_vocab_size_divisible_by: int = 128,
                       flag: str = "--load-dir") -> FullCheckpoint:
    """A local HF GPT-2 folder as a release ``FullCheckpoint`` (weights only: train from it
    with ``--finetune``). Tokenizer files found in the folder are recorded in its config."""
    hf = load_hf_model(hf_model_dir, flag)
    if hf.config.model_type in hf_llama.MODEL_TYPES:
        return _llama_checkpoint(hf, make_vocab_size_divisible_by, hf_model_dir)
    model_config = model_config_from_hf(
        hf.config, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=not hf.config.tie_word_embeddings)
    data = {"tokenizer_type": "GPT2BPETokenizer"}
    for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        path = os.path.join(hf_model_dir, name)
        if os.path.isfile(path):
            data[key] = os.path.abspath(path)
    config = with_layout({"model": to_dict(model_config), "data": data}, 1, 1)
    return FullCheckpoint(config=config,
                          model=HF_GPT2.to_ours(hf.state_dict(), model_config),
                          release=True)


def _llama_checkpoint(hf, make_vocab_size_divisible_by: int, hf_model_dir: str) -> FullCheckpoint:
    """A Llama-family model as a release ``FullCheckpoint`` (its tokenizer is given to
    training with the tokenizer flags)."""
    try:
        model_config = hf_llama.model_config_from_hf_llama(
            hf.config.to_dict(), make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    except ValueError as error:
        raise ConversionError(f"{os.path.join(hf_model_dir, 'config.json')}: {error}") from None
    config = with_layout({"model": to_dict(model_config), "data": {}}, 1, 1)
    model = hf_llama.HF_LLAMA.to_ours(hf.state_dict(), model_config)
    return FullCheckpoint(config=config, model=model, release=True)


TOKENIZER_DIR = "tokenizer"  # beside the tracker file of a checkpoint converted from HF


def save_keeping_tokenizer(full: FullCheckpoint, save_dir: str, tp: int = 1, pp: int = 1,
                           **kwargs) -> str:
    """``save_full_checkpoint`` for a checkpoint read from an HF folder: the tokenizer files it
    records (the folder's ``vocab.json`` and ``merges.txt``) are copied to ``SAVE/tokenizer/``
    and the saved config records the copies, so the converted checkpoint keeps its tokenizer
    when the HF folder goes away. Returns the iteration folder."""
    data = dict(full.config.get("data") or {})
    kept = os.path.join(os.path.abspath(save_dir), TOKENIZER_DIR)
    copies = []
    for key in ("vocab_file", "merge_file"):
        path = data.get(key)
        if path is not None and os.path.isfile(path):
            data[key] = os.path.join(kept, os.path.basename(path))
            copies.append((path, data[key]))
    full = dataclasses.replace(full, config={**full.config, "data": data})
    folder = save_full_checkpoint(full, save_dir, tp, pp, **kwargs)  # checks the layout first
    for path, target in copies:
        os.makedirs(kept, exist_ok=True)
        shutil.copyfile(path, target)
    return folder


def _is_llama_shaped(cfg) -> bool:
    return cfg.swiglu and cfg.normalization == "RMSNorm" and \
        cfg.position_embedding_type == "rope"


def _llama_hf_config(cfg):
    """The Llama (or, with QKV biases only, Qwen2) config of a Llama-shaped model; with
    experts, Qwen2-MoE's (a gated shared expert) or Mixtral's."""
    import transformers

    if cfg.rotary_interleaved or cfg.rotary_percent != 1.0:
        raise ConversionError("a Hugging Face Llama rotates whole heads by halves: this "
                              "checkpoint has --rotary-interleaved or --rotary-percent < 1")
    qwen = cfg.add_qkv_bias and not cfg.add_bias_linear
    fields = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
        head_dim=cfg.kv_channels, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.layernorm_epsilon, rope_theta=float(cfg.rotary_base),
        initializer_range=cfg.init_method_std, attention_dropout=cfg.attention_dropout,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights)
    if cfg.use_rope_scaling:
        fields["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": hf_llama.LOW_FREQ_FACTOR,
            "high_freq_factor": hf_llama.HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": hf_llama.LLAMA3_ORIGINAL_CONTEXT}
    if cfg.num_experts is not None:
        return _moe_hf_config(cfg, fields)
    if qwen:
        return transformers.Qwen2Config(**fields, architectures=["Qwen2ForCausalLM"])
    if cfg.add_qkv_bias != cfg.add_bias_linear:
        raise ConversionError("a Hugging Face Llama has biases on every linear layer or on "
                              "none: this checkpoint has --add-qkv-bias with other biases")
    return transformers.LlamaConfig(**fields, attention_bias=cfg.add_bias_linear,
                                    mlp_bias=cfg.add_bias_linear,
                                    architectures=["LlamaForCausalLM"])


def _moe_hf_config(cfg, fields: dict):
    """Qwen2-MoE's config of a model with a shared expert, else Mixtral's; what neither
    computes is refused naming our flag. Capacity, the z-loss and the load-balancing kind
    are training settings: the exported model routes every token (dropless)."""
    import transformers

    why = None
    if cfg.moe_router_score_function != "softmax":
        why = f"--moe-router-score-function {cfg.moe_router_score_function}: their routers " \
            "take a softmax"
    elif cfg.add_bias_linear:
        why = "linear-layer biases (no --disable-bias-linear): theirs have none"
    elif cfg.moe_shared_expert_intermediate_size is not None and not cfg.moe_shared_expert_gate:
        why = "--moe-shared-expert-intermediate-size without --moe-shared-expert-gate: " \
            "Qwen2-MoE gates its shared expert"
    if why is not None:
        raise ConversionError(f"a Hugging Face Mixtral or Qwen2-MoE cannot hold this "
                              f"checkpoint's experts: {why}")
    aux = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type != "none" else 0.0
    fields.update(num_experts_per_tok=cfg.moe_router_topk, router_aux_loss_coef=aux,
                  output_router_logits=aux > 0)
    if cfg.moe_shared_expert_intermediate_size is not None:
        fields.pop("head_dim")  # Qwen2-MoE's heads are hidden / heads wide (checked below)
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise ConversionError(f"a Hugging Face Qwen2-MoE's heads are --hidden-size / "
                                  f"heads wide: this checkpoint has --kv-channels "
                                  f"{cfg.kv_channels}")
        return transformers.Qwen2MoeConfig(
            **fields, num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size,
            shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(cfg.moe_layers) if not moe],
            qkv_bias=cfg.add_qkv_bias, use_sliding_window=False,
            architectures=["Qwen2MoeForCausalLM"])
    for given, flag, why in (
            (cfg.moe_router_pre_softmax, "--moe-router-pre-softmax",
             "its router renormalises the top-k probabilities"),
            (cfg.add_qkv_bias, "--add-qkv-bias", "its attention has no biases"),
            (not all(cfg.moe_layers), f"--moe-layer-freq {cfg.moe_layer_freq}",
             "each of its layers has experts")):
        if given:
            raise ConversionError(f"a Hugging Face Mixtral (the export of experts without a "
                                  f"shared expert) cannot hold {flag}: {why}")
    fields["intermediate_size"] = cfg.moe_ffn_hidden_size
    return transformers.MixtralConfig(**fields, num_local_experts=cfg.num_experts,
                                      sliding_window=None, router_jitter_noise=0.0,
                                      architectures=["MixtralForCausalLM"])


def hf_config_for(full: FullCheckpoint):
    """The ``transformers`` config of ``full``'s model: a Llama-family one for RMSNorm,
    SwiGLU and RoPE, else GPT-2's (its shape only)."""
    from transformers import GPT2Config

    cfg = full.model_config()
    if _is_llama_shaped(cfg):
        return _llama_hf_config(cfg)
    if cfg.position_embedding_type != "learned_absolute" or not cfg.add_bias_linear:
        raise ConversionError("a Hugging Face GPT-2 needs learned absolute positions and "
                              "biases: this checkpoint has --position-embedding-type "
                              f"{cfg.position_embedding_type}"
                              f"{'' if cfg.add_bias_linear else ' and --disable-bias-linear'}")
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        raise ConversionError(f"a Hugging Face GPT-2 needs --kv-channels x heads = hidden size; "
                              f"this checkpoint has {cfg.kv_channels} x "
                              f"{cfg.num_attention_heads} != {cfg.hidden_size}")
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
        n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
        n_inner=None if cfg.ffn_hidden_size == 4 * cfg.hidden_size else cfg.ffn_hidden_size,
        activation_function="gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        # GPT-2's <|endoftext|> is its last id (50256); a tokenizer of ours puts its eod last.
        bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,
        architectures=["GPT2LMHeadModel"])


def save_hf_checkpoint(full: FullCheckpoint, save_dir: str, vocab_file: Optional[str] = None,
                       merge_file: Optional[str] = None) -> list[str]:
    """Write ``full``'s model as an HF folder (GPT-2, or the Llama family's); returns the
    files written. GPT-2's tokenizer files come from the arguments, else from the paths the
    checkpoint's config recorded."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_config = hf_config_for(full)
    model_class = getattr(transformers, hf_config.architectures[0])
    adapter = HF_GPT2 if model_class.__name__ == "GPT2LMHeadModel" else hf_llama.HF_LLAMA
    state = adapter.from_ours(full.model, full.model_config())
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight")  # tied: from_pretrained sets it from the embeddings
    with torch.device("meta"):
        model = model_class(hf_config)
    if adapter is hf_llama.HF_LLAMA:
        state = hf_llama.fit_to_model(state, model.state_dict())
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ConversionError(f"the converted weights do not fit {model_class.__name__}: "
                              f"missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    os.makedirs(save_dir, exist_ok=True)
    model.save_pretrained(save_dir, safe_serialization=True)
    written = ["config.json", "model.safetensors"]
    return written + _copy_tokenizer_files(full, save_dir, vocab_file, merge_file)


def _copy_tokenizer_files(full: FullCheckpoint, save_dir: str, vocab_file: Optional[str],
                          merge_file: Optional[str]) -> list[str]:
    recorded = full.config.get("data") or {}
    written = []
    for given, key, flag, name in ((vocab_file, "vocab_file", "--vocab-file", "vocab.json"),
                                   (merge_file, "merge_file", "--merge-file", "merges.txt")):
        path = given or recorded.get(key)
        if path is None:
            continue
        if not os.path.isfile(path):
            where = flag if given else f"the checkpoint's recorded {flag}"
            raise ConversionError(f"{where} {path} does not exist: pass {flag} with the "
                                  "tokenizer file")
        shutil.copyfile(path, os.path.join(save_dir, name))
        written.append(name)
    return written

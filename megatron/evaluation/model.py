"""Build this rank's model and load the weights to evaluate: one function for every source.

``build_model_for_evaluation`` makes the model chunks of this rank's (tensor, pipeline) place
and fills them from ``--load`` (our checkpoint, at the layout it was saved with) or from a
local Hugging Face GPT-2 folder (converted in memory; tensor and pipeline size 1). A
resharding tool may later add other sources here; callers do not change.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch
from torch import nn

from megatron.config import RunConfig
from megatron.model.gpt_model import GPTModel


class EvaluationModelError(ValueError):
    """The model to evaluate cannot be built or loaded; the message names the flag."""


def hf_model_settings(hf_model_dir: str) -> dict[str, Any]:
    """The model flags (as config field names) of a local HF GPT-2 folder's config.json, for
    parsing the command line with them as defaults."""
    from transformers import GPT2Config

    from megatron.model.hf_gpt2 import model_config_from_hf

    if not os.path.isfile(os.path.join(hf_model_dir, "config.json")):
        raise EvaluationModelError(f"--hf-model {hf_model_dir!r} has no config.json")
    config = model_config_from_hf(GPT2Config.from_pretrained(hf_model_dir))
    fields = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "seq_length", "max_position_embeddings", "layernorm_epsilon", "activation")
    return {name: getattr(config, name) for name in fields}


def _model_chunks(cfg: RunConfig, device: torch.device) -> list[nn.Module]:
    from megatron.training import RunContext, build_model_chunks

    def provider(ctx, pre_process, post_process, first_layer, num_layers):
        return GPTModel(ctx.config.model, pre_process=pre_process, post_process=post_process,
                        first_layer=first_layer, num_layers=num_layers, device=device)

    return build_model_chunks(provider, RunContext(cfg, device=device))


def _load_checkpoint(chunks: list[nn.Module], cfg: RunConfig) -> int:
    """The weights of --load's latest checkpoint (no optimizer, schedule or generators);
    returns its iteration. A --load without a checkpoint is an error here."""
    from megatron import checkpointing

    ckpt = dataclasses.replace(cfg.checkpoint, no_load_optim=True, no_load_rng=True,
                               exit_on_missing_checkpoint=True)
    loaded = checkpointing.load_checkpoint(chunks, None, None, cfg.replace(checkpoint=ckpt))
    return loaded.report.iteration if loaded.report is not None else 0


def _load_hf(chunks: list[nn.Module], cfg: RunConfig, hf_model_dir: str) -> None:
    from transformers import GPT2LMHeadModel

    from megatron.model.hf_gpt2 import hf_to_megatron_state_dict

    p = cfg.parallel
    if len(chunks) != 1 or p.tensor_model_parallel_size != 1 or \
            p.pipeline_model_parallel_size != 1:
        raise EvaluationModelError(
            "--hf-model is evaluated at tensor and pipeline parallel size 1; for other "
            "layouts convert it first (tools/convert_hf_gpt2.py) and reshard the checkpoint")
    hf = GPT2LMHeadModel.from_pretrained(hf_model_dir, local_files_only=True)
    if hf.config.vocab_size != cfg.model.vocab_size:
        raise EvaluationModelError(
            f"--hf-model {hf_model_dir} has {hf.config.vocab_size} tokens, the tokenizer "
            f"{cfg.model.vocab_size}: give the tokenizer the model was trained with")
    state = hf_to_megatron_state_dict(hf.state_dict(), cfg.model)
    chunks[0].load_state_dict({k: v.to(cfg.model.params_dtype) for k, v in state.items()})


def build_model_for_evaluation(cfg: RunConfig, device: torch.device,
                               hf_model_dir: Optional[str] = None) -> tuple[list[nn.Module], int]:
    """This rank's model chunks in eval mode, loaded from ``hf_model_dir`` or from
    ``cfg.checkpoint.load``; returns them and the checkpoint's iteration (0 for HF).

    Every rank must call it (loading is collective). ``cfg`` must hold the tokenizer's
    vocabulary size (``with_vocab_size``) and the layout the checkpoint was saved with.
    """
    if hf_model_dir is None and cfg.checkpoint.load is None:
        raise EvaluationModelError("nothing to evaluate: give --load CHECKPOINT_DIR or "
                                   "--hf-model HF_GPT2_DIR")
    chunks = _model_chunks(cfg, device)
    iteration = 0
    if hf_model_dir is not None:
        _load_hf(chunks, cfg, hf_model_dir)
    else:
        iteration = _load_checkpoint(chunks, cfg)
    for chunk in chunks:
        chunk.eval()
    return chunks, iteration

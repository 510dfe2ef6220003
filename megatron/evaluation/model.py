"""Build this rank's model chunks for evaluation and load them through
``megatron.inference_loading`` (our checkpoints or Megatron-DeepSpeed's at any saved layout,
or a local Hugging Face GPT-2 folder), the loader generation uses too.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.config import RunConfig
from megatron.inference_loading import load_inference_weights
from megatron.model.gpt_model import GPTModel


def _model_chunks(cfg: RunConfig, device: torch.device) -> list[nn.Module]:
    from megatron.training import RunContext, build_model_chunks

    def provider(ctx, pre_process, post_process, first_layer, num_layers):
        return GPTModel(ctx.config.model, pre_process=pre_process, post_process=post_process,
                        first_layer=first_layer, num_layers=num_layers, device=device)

    return build_model_chunks(provider, RunContext(cfg, device=device))


def build_model_for_evaluation(cfg: RunConfig, device: torch.device,
                               hf_model_dir: Optional[str] = None) -> tuple[list[nn.Module], int]:
    """This rank's model chunks (virtual stages included) in eval mode, loaded from
    ``hf_model_dir`` or from ``cfg.checkpoint.load``; returns them and the checkpoint's
    iteration (0 for HF). Every rank must call it; ``cfg`` must hold the tokenizer's
    vocabulary size (``with_vocab_size``)."""
    chunks = _model_chunks(cfg, device)
    return chunks, load_inference_weights(chunks, cfg, hf_model_dir)

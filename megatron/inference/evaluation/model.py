"""Build this rank's model chunks for evaluation and load them through
``megatron.inference.loading`` (our checkpoints or Megatron-DeepSpeed's at any saved layout,
or a local Hugging Face GPT-2 folder), the loader generation uses too.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.assembly.build import RunContext, build_model_chunks, gpt_model_provider
from megatron.config import RunConfig
from megatron.inference.loading import load_inference_weights


def _model_chunks(cfg: RunConfig, device: torch.device) -> list[nn.Module]:
    return build_model_chunks(gpt_model_provider, RunContext(cfg, device=device))


def build_model_for_evaluation(cfg: RunConfig, device: torch.device,
                               hf_model_dir: Optional[str] = None) -> tuple[list[nn.Module], int]:
    """This rank's model chunks (virtual stages included) in eval mode, loaded from
    ``hf_model_dir`` or from ``cfg.checkpoint.load``; returns them and the checkpoint's
    iteration (0 for HF). Every rank must call it; ``cfg`` must hold the tokenizer's
    vocabulary size (``with_vocab_size``)."""
    chunks = _model_chunks(cfg, device)
    return chunks, load_inference_weights(chunks, cfg, hf_model_dir)

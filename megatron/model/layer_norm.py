"""The layer norms: LayerNorm (apex's fused kernel on CUDA when installed, torch's otherwise:
the same numbers) or RMSNorm (``--normalization RMSNorm``, torch's)."""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig


def _apex_layer_norm_class():
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError:
        return None
    return FusedLayerNorm


def apex_layer_norm_used(config: ModelConfig, device) -> bool:
    """Whether LayerNorms built on ``device`` are apex's: asked for (``apex_layernorm``), on
    CUDA, and apex installed. The run records the answer in its config, so the arguments
    block shows what is really used."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return config.apex_layernorm and on_cuda and _apex_layer_norm_class() is not None


def build_layer_norm(config: ModelConfig, *, device=None) -> nn.Module:
    """A LayerNorm (or RMSNorm) over the hidden size. Under sequence parallelism its
    parameters see only this rank's tokens, so they are marked for a gradient all-reduce over
    tensor ranks."""
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device,
                          dtype=config.params_dtype)
    elif apex_layer_norm_used(config, device):
        apex_cls = _apex_layer_norm_class()
        norm = apex_cls(config.hidden_size, eps=config.layernorm_epsilon).to(
            device=device, dtype=config.params_dtype)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device,
                            dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm

"""Rotary position embeddings (RoPE), rotating the first ``rotary_percent`` of each head.

Two channel layouts exist: the halves of each head (channel i pairs with i + r/2; Hugging
Face's, Megatron's default) or adjacent pairs (2i with 2i + 1; GPT-J's, Meta's Llama code:
``--rotary-interleaved``). Llama 3.1's scaling (``--use-rope-scaling``) slows the
low-frequency channels by ``--rope-scaling-factor`` and blends a band between.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

# Llama 3.1's scaling band: wavelengths beyond original_context / LOW_FREQ_FACTOR are
# slowed by the factor, those below original_context / HIGH_FREQ_FACTOR kept.
LLAMA3_ORIGINAL_CONTEXT = 8192
LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR = 1.0, 4.0


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's frequency scaling of ``inv_freq`` (its reference code's rule)."""
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LOW_FREQ_FACTOR) / (
        HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(band, blended, out)


def rotary_freqs(seq_length: int, head_dim: int, rotary_percent: float = 1.0,
                 base: int = 10000, device=None, interleaved: bool = False,
                 scaling_factor: Optional[float] = None) -> torch.Tensor:
    """Angles ``[s, 1, 1, rot_dim]`` (fp32) for positions 0..s-1: each frequency twice, in
    the channel layout ``interleaved`` names; ``scaling_factor``: Llama 3.1's scaling."""
    rot_dim = int(head_dim * rotary_percent)
    rot_dim -= rot_dim % 2
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device)
                               / rot_dim))
    if scaling_factor is not None:
        inv_freq = llama3_scaled(inv_freq, scaling_factor)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat([angles, angles], dim=-1)
    return angles[:, None, None, :]


def model_rotary_freqs(config: Any, seq_length: int, device=None) -> torch.Tensor:
    """``rotary_freqs`` of a ``ModelConfig``'s RoPE settings."""
    return rotary_freqs(seq_length, config.kv_channels, config.rotary_percent,
                        config.rotary_base, device=device,
                        interleaved=config.rotary_interleaved,
                        scaling_factor=config.rope_scaling_factor if config.use_rope_scaling
                        else None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))  # [..., r/2, 2]
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, n, d]`` by ``freqs`` ``[s, 1, 1, r]`` on its first r channels."""
    r = freqs.size(-1)
    rot, rest = x[..., :r], x[..., r:]
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    rotated = _rotate_pairs(rot) if interleaved else _rotate_half(rot)
    rot = rot * cos + rotated * sin
    return torch.cat([rot, rest], dim=-1) if rest.numel() else rot

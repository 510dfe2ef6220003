"""Rotary position embeddings (RoPE), rotating the first ``rotary_percent`` of each head."""

from __future__ import annotations

import torch


def rotary_freqs(seq_length: int, head_dim: int, rotary_percent: float = 1.0,
                 base: int = 10000, device=None) -> torch.Tensor:
    """Angles ``[s, 1, 1, rot_dim]`` (fp32) for positions 0..s-1, duplicated for both halves."""
    rot_dim = int(head_dim * rotary_percent)
    rot_dim -= rot_dim % 2
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device)
                               / rot_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, n, d]`` by ``freqs`` ``[s, 1, 1, r]`` on its first r channels."""
    r = freqs.size(-1)
    rot, rest = x[..., :r], x[..., r:]
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    rot = rot * cos + _rotate_half(rot) * sin
    return torch.cat([rot, rest], dim=-1) if rest.numel() else rot

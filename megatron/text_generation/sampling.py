"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

As in Megatron, ``top_k == 1`` is greedy, ``top_k == 0`` and ``top_p == 0`` mean no cut, and
top-k and top-p are not combined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``temperature`` divides the logits (0 < t); ``top_k`` keeps the k
    most likely tokens (0: all, 1: greedy); ``top_p`` keeps the smallest set whose probability
    reaches p (0: all)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be between 0 and 1, got {self.top_p}")
        if self.top_k > 1 and self.top_p > 0.0:
            raise ValueError("top_k and top_p cannot both be set (as in Megatron)")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(logits, min(k, logits.size(-1)), dim=-1).values[:, -1:]  # [b, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, V]
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach p (the first is always kept).
    drop_sorted = probs.cumsum(dim=-1) - probs >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, vocab_size: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids ``[b]`` (int64) from logits ``[b, V]`` (any float dtype; computed in
    fp32). Ids at or beyond ``vocab_size`` (the padding of the embedding) are never drawn, and
    the draw does not depend on the padding."""
    # Cut rather than mask the padding: draws then do not depend on how much padding the
    # tensor-parallel size added.
    logits = logits[:, :vocab_size].float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k > 1:
        logits = _keep_top_k(logits, params.top_k)
    elif params.top_p > 0.0:
        logits = _keep_top_p(logits, params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

As in Megatron, ``top_k == 1`` is greedy and ``top_k == 0`` and ``top_p == 0`` mean no cut
(``top_p == 1`` keeps every token too). Both may be set: the logits are divided by the
temperature, cut to the ``top_k`` likeliest, and then to the smallest set of those whose
probability (renormalised over the k) reaches ``top_p``, in the order of Hugging Face's
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (and of nanoGPT-style
samplers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``temperature`` divides the logits (0 < t); ``top_k`` keeps the k
    most likely tokens (0: all, 1: greedy); ``top_p`` then keeps the smallest set whose
    probability reaches p (0 or 1: all)."""

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


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits ``[b, V]`` (fp32) the next token is drawn from: divided by the
    temperature, then cut to top-k, then to top-p (a cut token's logit is -inf)."""
    logits = logits.float() / params.temperature
    if params.top_k > 1:
        logits = _keep_top_k(logits, params.top_k)
    if 0.0 < params.top_p < 1.0:
        logits = _keep_top_p(logits, params.top_p)
    return logits


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
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

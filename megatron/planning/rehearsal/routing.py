"""Balanced routing while a rank is rehearsed.

A mixture-of-experts layer's communication has data-dependent sizes: how many tokens each
rank sends each expert (the all-to-all's splits) and how many rows each expert computes (its
tensor-parallel all-reduces) follow the router. Over the fake backend the values are
synthetic, so the sizes would be arbitrary, differ between the ranks of a class (which the
rehearsal claims alike) and between a rank's own send and its peer's receive. The rehearsal
therefore routes evenly: token i of the T a layer routes gets, among all E experts, those of
its slots i k ... i k + k - 1 (slot mod E); expert j then has ceil((T k - j) / E) tokens on
every rank, the figure the planner uses (megatron/planning/experts.py). Everything else is the
layer's own code: the router's logits, scores and losses, capacity, dispatch, the experts.
Where E does not divide T k the experts' loads differ by a token, so do the ranks of an
expert group, and the classes mode says they are not alike: rehearse with --rehearse-ranks
all (every all-to-all is then matched split by split).

The choice is imposed by lifting the chosen logits above all others before
``megatron.model.moe.route`` takes its top k (the softmax over the chosen logits is
unchanged by a common lift).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron.model import moe


def balanced_choice(tokens: int, experts: int, topk: int, device=None) -> torch.Tensor:
    """``[tokens, topk]`` expert numbers: token i's slot j goes to ``(i k + j) mod E``."""
    slots = torch.arange(tokens, device=device).unsqueeze(1) * topk + torch.arange(
        topk, device=device)
    return slots % experts


def steer(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """``logits`` ``[T, E]`` with the balanced choice's entries lifted above every other."""
    chosen = balanced_choice(logits.size(0), logits.size(1), topk, logits.device)
    lift = logits.detach().abs().amax() * 2 + 1
    return logits + torch.zeros_like(logits).scatter(1, chosen, 1.0) * lift


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside, every mixture-of-experts layer routes evenly (module docstring)."""
    original = moe.route

    def route(logits: torch.Tensor, topk: int, *args, **kwargs):
        return original(steer(logits, topk), topk, *args, **kwargs)

    moe.route = route
    try:
        yield
    finally:
        moe.route = original

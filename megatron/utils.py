"""Helpers shared by the entry scripts and the loop: masks and position ids for
left-to-right LMs, and printing on rank 0."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def print_rank_0(message: str) -> None:
    """Print (flushed) on global rank 0 only, or always before torch.distributed is up."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: Optional[int],
                                    reset_position_ids: bool, reset_attention_mask: bool,
                                    eod_mask_loss: bool):
    """Masks for a batch of token ids ``[b, s]`` (Megatron's semantics).

    Returns ``(attention_mask, loss_mask, position_ids)``: ``attention_mask`` is None for the
    plain causal mask, or bool ``[b, 1, s, s]`` with True = masked when documents must not
    attend across their EOD boundaries (``reset_attention_mask``); ``loss_mask`` ``[b, s]``
    float, zero at EOD tokens with ``eod_mask_loss``; ``position_ids`` ``[b, s]``, restarting
    after each EOD with ``reset_position_ids``.
    """
    b, s = tokens.shape
    loss_mask = torch.ones(b, s, dtype=torch.float, device=tokens.device)
    if eod_mask_loss and eod_token is not None:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long, device=tokens.device).expand(b, s).clone()
    attention_mask = None
    if reset_attention_mask:
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=tokens.device))
        attention_mask = causal.expand(b, 1, s, s).clone()
    if (reset_position_ids or reset_attention_mask) and eod_token is not None:
        for row in range(b):
            eods = (tokens[row] == eod_token).nonzero().flatten().tolist()
            start = 0
            for eod in eods:
                if reset_attention_mask:
                    attention_mask[row, 0, eod + 1:, : eod + 1] = False
                if reset_position_ids:
                    position_ids[row, eod + 1:] -= eod + 1 - start
                start = eod + 1
    if attention_mask is not None:
        attention_mask = ~attention_mask  # True = masked out
    return attention_mask, loss_mask, position_ids

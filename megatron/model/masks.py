"""Attention masks, loss masks and position ids of a batch of token ids, as Megatron makes them
for left-to-right language models (documents separated by EOD tokens)."""

from __future__ import annotations

from typing import Optional

import torch


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
    device = tokens.device
    loss_mask = torch.ones(b, s, dtype=torch.float, device=device)
    positions = torch.arange(s, dtype=torch.long, device=device)
    # Element-wise only: nothing here waits for the device (no boolean indexing, no .tolist()).
    is_eod = tokens == eod_token if eod_token is not None else None
    if eod_mask_loss and is_eod is not None:
        loss_mask.masked_fill_(is_eod, 0.0)
    doc_start = torch.zeros(b, s, dtype=torch.long, device=device)
    if (reset_position_ids or reset_attention_mask) and is_eod is not None:
        # A document starts one past each EOD: position p's document starts one past the
        # last EOD before p (a running maximum, shifted by one position).
        after_eod = torch.where(is_eod, positions + 1, 0)
        doc_start[:, 1:] = after_eod.cummax(dim=1).values[:, :-1]
    position_ids = positions.expand(b, s) - (doc_start if reset_position_ids else 0)
    attention_mask = None
    if reset_attention_mask:
        keys = positions.view(1, 1, 1, s)
        queries = positions.view(1, 1, s, 1)
        visible = (keys <= queries) & (keys >= doc_start.view(b, 1, s, 1))  # [b, 1, s, s]
        attention_mask = ~visible  # True = masked out
    return attention_mask, loss_mask, position_ids

"""GPT's micro-batch and loss, one of each: pretrain_gpt.py's callbacks and DeepSpeed's
pipeline engine (megatron/integrations/deepspeed/) both read a sample through
``gpt_batch`` and reduce per-token losses through ``masked_mean_loss``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from megatron.config import DataConfig
from megatron.model.masks import get_ltor_masks_and_position_ids


class GPTBatch(NamedTuple):
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]: the tokens shifted by one
    loss_mask: torch.Tensor  # [b, s] float
    attention_mask: Optional[torch.Tensor]  # None: causal; else bool [b, 1, s, s], True masked
    position_ids: torch.Tensor  # [b, s]


def gpt_batch(sample: torch.Tensor, eod: Optional[int], data: DataConfig,
              causal_only: bool = False) -> GPTBatch:
    """The batch of ``sample`` (token ids ``[b, s + 1]``, on the compute device): tokens and
    labels, and the masks and positions --reset-position-ids, --reset-attention-mask and
    --eod-mask-loss ask for (``causal_only``: the causal mask whatever is asked, where only
    the hidden state travels between stages)."""
    sample = sample.long()
    tokens, labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, data.reset_position_ids, data.reset_attention_mask and not causal_only,
        data.eod_mask_loss)
    return GPTBatch(tokens, labels, loss_mask, attention_mask, position_ids)


def masked_mean_loss(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the per-token ``losses`` ``[b, s]`` where the loss mask is one. (Under XLA
    SPMD, where a batch holds several devices' micro-batches, the XLA engine takes each
    device's mean through this: megatron/training/xla_step.py ``split_over_devices``.)"""
    losses = losses.float()
    return torch.sum(losses.reshape(-1) * loss_mask.reshape(-1)) / loss_mask.sum()

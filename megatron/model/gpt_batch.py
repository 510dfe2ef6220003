"""GPT's micro-batch and loss, one of each: pretrain_gpt.py's callbacks and DeepSpeed's
pipeline engine (megatron/integrations/deepspeed/) both read a sample through
``gpt_batch`` and reduce per-token losses through ``masked_mean_loss``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.config import DataConfig
from megatron.core import context_parallel, parallel_state
from megatron.model.masks import get_ltor_masks_and_position_ids


class GPTBatch(NamedTuple):
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]: the tokens shifted by one
    loss_mask: torch.Tensor  # [b, s] float
    attention_mask: Optional[torch.Tensor]  # None: causal; else bool [b, 1, s, s], True masked
    position_ids: torch.Tensor  # [b, s]


def gpt_batch(sample: torch.Tensor, eod: Optional[int], data: DataConfig,
              causal_only: bool = False, context_attention: str = "p2p") -> GPTBatch:
    """The batch of ``sample`` (token ids ``[b, s + 1]``, on the compute device): tokens and
    labels, and the masks and positions --reset-position-ids, --reset-attention-mask and
    --eod-mask-loss ask for (``causal_only``: the causal mask whatever is asked, where only
    the hidden state travels between stages). Under context parallelism, this rank's tokens
    of each (``context_attention``, the run's kind, says which), with their global positions.
    """
    sample = sample.long()
    tokens, labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, data.reset_position_ids, data.reset_attention_mask and not causal_only,
        data.eod_mask_loss)
    if parallel_state.get_context_parallel_world_size() > 1:
        if attention_mask is not None:
            raise ValueError("context parallelism attends causally: no attention mask")
        tokens, labels, loss_mask, position_ids = (
            context_parallel.shard(t, 1, context_attention)
            for t in (tokens, labels, loss_mask, position_ids))
    return GPTBatch(tokens, labels, loss_mask, attention_mask, position_ids)


def masked_mean_loss(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the per-token ``losses`` ``[b, s]`` where the loss mask is one (under context
    parallelism, the context group's size times this rank's share of it). (Under XLA
    SPMD, where a batch holds several devices' micro-batches, the XLA engine takes each
    device's mean through this: megatron/training/xla_step.py ``split_over_devices``.)"""
    losses = losses.float()
    total = torch.sum(losses.reshape(-1) * loss_mask.reshape(-1))
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return total / loss_mask.sum()
    # This rank holds part of each sequence: its sum over the tokens of the whole context
    # group. Times the group's size, because gradients and the reported loss are averaged
    # over data x context ranks (a rank whose tokens are all masked adds zero, not NaN).
    count = loss_mask.sum().float()
    dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
    return total * cp / count

"""One GPT batch and loss: pretrain_gpt.py's callbacks and DeepSpeed's pipeline path read the
same sample to the same tensors and reduce the same losses to the same value."""

from __future__ import annotations

import torch

import pretrain_gpt
from megatron.config import DataConfig
from megatron.core import parallel_state
from megatron.model.gpt_batch import gpt_batch, masked_mean_loss
from megatron.model.gpt_model_pipe import lm_loss


def test_the_pipeline_batch_is_the_callbacks_batch_with_the_causal_mask():
    sample = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [1, 2, 3, 0, 4, 5, 6]])
    data = DataConfig(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    full = gpt_batch(sample, 0, data)
    pipe = gpt_batch(sample, 0, data, causal_only=True)
    assert full.attention_mask is not None and pipe.attention_mask is None
    for a, b in zip(full, pipe):
        if a is not None and b is not None:
            assert torch.equal(a, b)
    assert full.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2]
    assert full.loss_mask[0].tolist() == [1, 1, 0, 1, 1, 0]


def test_the_pipeline_loss_is_the_callbacks_loss():
    parallel_state.destroy_model_parallel()  # tensor parallel 1 (the cross entropy's group)
    torch.manual_seed(0)
    logits = torch.randn(6, 2, 11)  # [s, b, V]
    targets = torch.randint(0, 11, (2, 6))
    mask = (torch.rand(2, 6) > 0.3).float()
    per_token = torch.nn.functional.cross_entropy(
        logits.permute(1, 2, 0), targets, reduction="none")  # [b, s]
    loss, reported = pretrain_gpt.loss_func(mask, per_token)
    assert torch.allclose(lm_loss(logits, (targets, mask)), loss, atol=1e-6)
    assert torch.allclose(masked_mean_loss(per_token, mask), reported["lm loss"])

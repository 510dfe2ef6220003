"""The CPU side of paths written for GPUs: what they do where no GPU is.

- ``--use-flash-attn`` without the flash_attn package runs PyTorch's SDPA (same numbers as
  without the flag) instead of refusing to start;
- RNG states saved on another device type (a GPU checkpoint loaded on the CPU) are detected,
  and loading keeps this run's tracker instead of failing;
- the Megatron memory line is GPU-only.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.checkpointing import rng as checkpoint_rng
from megatron.core.tensor_parallel import get_rng_tracker, model_parallel_seed
from megatron.model import transformer
from megatron.model.gpt_model import GPTModel
from megatron.training.log import format_memory_report
from tests.distributed.tp_utils import batch, tiny_config


def test_flash_attn_flag_without_the_package_runs_sdpa(monkeypatch):
    monkeypatch.setattr(transformer, "_flash_attn_func", lambda: None)
    assert not transformer.flash_attn_installed()
    config = tiny_config()
    tokens = batch(config)
    outputs = []
    for flag in (False, True):
        model_parallel_seed(1)
        model = GPTModel(tiny_config(use_flash_attn=flag))
        outputs.append(model(tokens[:, :-1], labels=tokens[:, 1:]))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_rng_states_from_a_gpu_do_not_fit_a_cpu_tracker(caplog):
    model_parallel_seed(5)
    tracker = get_rng_tracker()
    assert tracker.device_type == "cpu"
    own = tracker.get_states()
    assert tracker.fits(own)
    # A CUDA (Philox) generator state is 16 bytes: seed and offset.
    from_gpu = {name: torch.zeros(16, dtype=torch.uint8) for name in own}
    assert not tracker.fits(from_gpu)

    saved = checkpoint_rng.capture_rng_state()
    saved["rng_tracker_states"] = from_gpu
    saved["cuda_rng_state"] = torch.zeros(16, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="megatron.checkpointing"):
        checkpoint_rng.restore_rng_state(saved)  # neither state is applied to the CPU
    assert "another device type" in caplog.text
    for name, state in tracker.get_states().items():
        assert torch.equal(state, own[name])


def test_memory_report_is_gpu_only():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process")
    assert format_memory_report(0, 1) is None

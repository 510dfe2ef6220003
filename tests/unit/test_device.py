"""The device and backend decision (megatron.platform.device), and the device recorded for the run.

Whether a GPU is visible is faked with monkeypatch, so each branch runs on a CPU machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.core import parallel_state
from megatron.platform import device as device_mod

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
        "--mock-data").split()


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)`` makes torch report n visible GPUs (0: none)."""
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


@pytest.mark.parametrize("visible,use_cpu,expected", [
    (0, False, "gloo"), (0, True, "gloo"), (2, False, "nccl"), (2, True, "gloo")])
def test_auto_backend_follows_the_device(gpus, visible, use_cpu, expected):
    gpus(visible)
    assert device_mod.resolve_backend("auto", use_cpu) == expected
    assert device_mod.compute_device_type(use_cpu) == ("cuda" if expected == "nccl" else "cpu")


def test_nccl_without_a_gpu_falls_back_to_gloo_with_a_warning(gpus, caplog):
    gpus(0)
    with caplog.at_level(logging.WARNING, logger="megatron.platform.device"):
        assert device_mod.resolve_backend("nccl", use_cpu=False) == "gloo"
    assert "none is visible" in caplog.text


def test_nccl_with_use_cpu_is_refused_naming_both_flags(gpus):
    gpus(1)
    with pytest.raises(ValueError, match="--distributed-backend nccl.*--use-cpu"):
        device_mod.resolve_backend("nccl", use_cpu=True)
    with pytest.raises(ConfigError, match="--use-cpu"):
        parse_args(TINY + ["--use-cpu", "--distributed-backend", "nccl"], world_size=1)


def test_gloo_on_a_gpu_is_kept(gpus):
    gpus(1)
    assert device_mod.resolve_backend("gloo", use_cpu=False) == "gloo"
    line = device_mod.describe(torch.device("cuda", 0), "gloo", use_cpu=False)
    assert "host memory" in line


def test_each_process_takes_the_gpu_of_its_local_rank(gpus):
    gpus(4)
    assert device_mod.compute_device(False, local_rank=3) == torch.device("cuda", 3)
    assert device_mod.compute_device(False, local_rank=5) == torch.device("cuda", 1)
    assert device_mod.compute_device(True, local_rank=3) == torch.device("cpu")


def test_use_cpu_is_said_in_the_log_line(gpus):
    gpus(2)
    line = device_mod.describe(torch.device("cpu"), "gloo", use_cpu=True)
    assert line.startswith("> compute device: cpu, collectives: gloo")
    assert "--use-cpu, although 2 GPU(s) are visible" in line
    gpus(0)
    assert "no GPU is visible" in device_mod.describe(torch.device("cpu"), "gloo", False)


def test_flags_reach_the_training_config(gpus):
    gpus(0)
    t = parse_args(TINY + ["--use-cpu", "--deterministic-mode"], world_size=1).training
    assert t.use_cpu and t.deterministic_mode and t.distributed_backend == "gloo"
    gpus(1)
    t = parse_args(TINY, world_size=1).training
    assert not t.use_cpu and t.distributed_backend == "nccl"


def test_recorded_device_wins_and_is_forgotten_with_the_groups():
    assert parallel_state.get_default_device() == torch.device("cpu")
    parallel_state.set_default_device(torch.device("meta"))
    try:
        assert parallel_state.get_default_device() == torch.device("meta")
    finally:
        parallel_state.destroy_model_parallel()
    assert parallel_state.get_default_device() == torch.device("cpu")


def test_library_use_without_groups_stays_on_the_cpu(gpus):
    gpus(1)  # a visible GPU alone does not move library code (tests, tools) onto it
    assert parallel_state.get_default_device() == torch.device("cpu")

"""Which device a run computes on and which backend carries its collectives: decided here.

The device comes first: CUDA wherever a GPU is visible (each process takes the GPU of its
``LOCAL_RANK``), the CPU only when none is or when ``--use-cpu`` asks for it. The backend
follows the device: NCCL for CUDA, gloo for the CPU. ``--distributed-backend`` may still name
one: ``nccl`` without a GPU falls back to gloo with a warning (Megatron scripts pass it
everywhere), and ``gloo`` on a GPU is kept, carrying CUDA tensors (slowly: meant for tests that
put several ranks on one GPU, which NCCL refuses).

Every tensor that feeds the model or a collective lives on the chosen device, control values
(flags, loss sums, timings) included: NCCL carries nothing else, and one backend per group
keeps start-up cheap at scale. ``megatron.core.parallel_state.get_default_device`` hands the
device to code below the training loop.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "nccl", "gloo")


def compute_device_type(use_cpu: bool) -> str:
    """``"cuda"`` where a GPU is visible and the CPU was not asked for, else ``"cpu"``."""
    return "cuda" if not use_cpu and torch.cuda.is_available() else "cpu"


def compute_device(use_cpu: bool, local_rank: int) -> torch.device:
    """This process's device: the GPU of its local rank (modulo the visible GPUs), or the CPU."""
    if compute_device_type(use_cpu) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_backend(requested: str, use_cpu: bool) -> str:
    """The backend for ``--distributed-backend requested`` on this machine (see the module
    docstring); raises ValueError where the two flags contradict each other."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"--distributed-backend must be nccl or gloo, got {requested!r}")
    device_type = compute_device_type(use_cpu)
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and use_cpu:
        raise ValueError("--distributed-backend nccl carries only CUDA tensors, but --use-cpu "
                         "trains on the CPU: drop one of the two flags")
    if requested == "nccl" and device_type == "cpu":
        logger.warning("--distributed-backend nccl needs a GPU and none is visible: using gloo "
                       "on the CPU")
        return "gloo"
    return requested


def describe(device: torch.device, backend: str, use_cpu: bool) -> str:
    """The log line that says where the run computes, and why where it may surprise."""
    line = f"> compute device: {device}, collectives: {backend}"
    if use_cpu:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        line += " (--use-cpu" + (f", although {visible} GPU(s) are visible)" if visible else ")")
    elif device.type == "cpu":
        line += " (no GPU is visible)"
    elif backend == "gloo":
        line += (" (--distributed-backend gloo: CUDA tensors go through host memory, slowly; "
                 "NCCL is the default on a GPU)")
    return line

"""Which device a run computes on and which backend carries its collectives: decided here.

The device comes first: an XLA device when ``--device xla`` asks for it, or when
``PJRT_DEVICE`` is set and torch_xla is importable (``megatron.platform.xla``); else CUDA wherever a
GPU is visible (each process takes the GPU of its ``LOCAL_RANK``), the CPU only when none is
or when ``--use-cpu`` asks for it. The backend follows the device: NCCL for CUDA, gloo for
the CPU, torch_xla's ``xla`` backend (with gloo for host values) for XLA. ``--distributed-backend`` may still name
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
import os
from typing import Optional

import torch

from megatron.platform import xla

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "nccl", "gloo", "xla")
DEVICE_CHOICES = ("auto", "cuda", "cpu", "xla")
# torch_xla X.Y runs on torch X.Y only, and its releases stop at 2.9 (newer torch has none):
# the message names a pair that exists rather than one derived from this torch's version.
XLA_MISSING = ("--device xla needs torch_xla, which is not installed here. torch_xla X.Y "
               "needs torch X.Y exactly and is released up to 2.9: e.g. pip install "
               "torch==2.9.0 torch_xla==2.9.0 (README, 'XLA (TPU)')")


def compute_device_type(use_cpu: bool, requested: str = "auto", xla_allowed: bool = True) -> str:
    """``"xla"`` for ``--device xla`` or PJRT_DEVICE with torch_xla installed (unless
    ``--use-cpu``, or for callers that do not run on XLA: ``xla_allowed=False``, the
    generation and evaluation tools); ``"cuda"`` where a GPU is visible and the CPU was not
    asked for; else ``"cpu"``. Raises ValueError for a ``--device`` this machine cannot give."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")
    if requested == "xla" or (requested == "auto" and not use_cpu and xla_allowed
                              and xla.requested_by_environment()):
        if use_cpu:
            raise ValueError("--device xla and --use-cpu contradict each other: drop one")
        if not xla.torch_xla_importable():
            raise ValueError(XLA_MISSING)
        return "xla"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible")
    if requested == "cpu" or use_cpu:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_device(use_cpu: bool, local_rank: int, requested: str = "auto",
                   xla_allowed: bool = True) -> torch.device:
    """This process's device: its XLA device, the GPU of its local rank (modulo the visible
    GPUs), or the CPU."""
    device_type = compute_device_type(use_cpu, requested, xla_allowed)
    if device_type == "xla":
        return xla.device()
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_backend(requested: str, use_cpu: bool, device: str = "auto",
                    xla_allowed: bool = True) -> str:
    """The backend for ``--distributed-backend requested`` on this machine (see the module
    docstring); raises ValueError where the flags contradict each other."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"--distributed-backend must be nccl, gloo or xla, got {requested!r}")
    device_type = compute_device_type(use_cpu, device, xla_allowed)
    if device_type == "xla":
        if requested not in ("auto", "xla"):
            raise ValueError(f"--distributed-backend {requested} cannot carry XLA tensors: "
                             "an XLA device (--device xla, or PJRT_DEVICE) uses the xla backend")
        return "xla"
    if requested == "xla":
        raise ValueError("--distributed-backend xla needs an XLA device (--device xla, or "
                         "PJRT_DEVICE with torch_xla installed)")
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


def describe(device: torch.device, backend: str, use_cpu: bool,
             xla_spmd_devices: Optional[int] = None) -> str:
    """The log line that says where the run computes, and why where it may surprise."""
    if xla_spmd_devices is not None:
        return (f"> compute device: {device}, XLA SPMD over {xla_spmd_devices} device(s) "
                f"({xla.PJRT_ENV}={os.environ.get(xla.PJRT_ENV, 'unset')}; each micro-batch "
                "split along its batch dimension, one data-parallel rank per device), "
                "collectives: XLA's (the gradient all-reduce inserted by its partitioner; "
                "host values over gloo)")
    line = f"> compute device: {device}, collectives: {backend}"
    if use_cpu:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        line += " (--use-cpu" + (f", although {visible} GPU(s) are visible)" if visible else ")")
    elif device.type == "xla":
        line += f" ({xla.PJRT_ENV}={os.environ.get(xla.PJRT_ENV, 'unset')}; host values over gloo)"
    elif device.type == "cpu":
        line += " (no GPU is visible)"
    elif backend == "gloo":
        line += (" (--distributed-backend gloo: CUDA tensors go through host memory, slowly; "
                 "NCCL is the default on a GPU)")
    return line

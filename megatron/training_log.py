"""The Megatron log line, TensorBoard scalars, and the FLOPs count behind TFLOP/s.

FLOPs of one training iteration (forward + backward, a matmul of m x k by k x n counted as
2mkn), for B sequences of s tokens, L layers, hidden h, FFN width f, attention projection
width a (= heads x kv_channels) and padded vocabulary V::

    per token, forward:  L * (2*h*3a  +  2*a*h  +  2*2*h*f  +  2*2*s*a)  +  2*h*V
                              qkv        proj      MLP        scores, weighted sum
    training:            3 x forward (backward costs twice the forward)

With f = 4h and a = h this is Megatron's ``72 B s L h^2 (1 + s/(6h) + V/(12 h L))``. We report
*model* FLOPs: recomputed activations are not counted, so TFLOP/s is comparable across
recompute settings (MFU, not HFU).
"""

from __future__ import annotations

import math
import resource
from typing import Optional

import torch

from megatron.config import ModelConfig


def flops_per_token(config: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Training FLOPs per token (forward + backward) of the formula in the module docstring."""
    s = seq_length or config.seq_length
    h, f, a = config.hidden_size, config.ffn_hidden_size, config.projection_size
    per_layer = 2 * h * 3 * a + 2 * a * h + 4 * h * f + 4 * s * a
    forward = config.num_layers * per_layer + 2 * h * config.padded_vocab_size
    return 3.0 * forward


def memory_gb() -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_memory_report(rank: int, iteration: int) -> Optional[str]:
    """Megatron's memory line for this process's GPU (MB; None on the CPU)::

        [Rank 0] (after 10 iterations) memory (MB) | allocated: ... | max allocated: ...
        | reserved: ... | max reserved: ...

    allocated: tensors alive now; reserved: what the caching allocator holds from the driver
    (what nvidia-smi shows, less the CUDA context); max: peaks since the start.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    mb = 2.0**20
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
            f" | allocated: {torch.cuda.memory_allocated() / mb:.1f}"
            f" | max allocated: {torch.cuda.max_memory_allocated() / mb:.1f}"
            f" | reserved: {torch.cuda.memory_reserved() / mb:.1f}"
            f" | max reserved: {torch.cuda.max_memory_reserved() / mb:.1f}")


def format_log_line(*, iteration: int, train_iters: int, consumed_samples: int,
                    elapsed_ms: float, lr: float, global_batch_size: int,
                    losses: dict[str, float], loss_scale: Optional[float],
                    grad_norm: Optional[float], skipped: int, nan: int, tgs: float,
                    tflops: float, num_zeros: Optional[float] = None,
                    params_norm: Optional[float] = None) -> str:
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    parts += [f"{name}: {value:.6E}" for name, value in losses.items()]
    if loss_scale is not None:
        parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros:.1f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [
        f"number of skipped iterations: {skipped:3d}",
        f"number of nan iterations: {nan:3d}",
        f"tokens per GPU per second (TGS): {tgs:.1f}",
        f"TFLOP/s per GPU: {tflops:.3f}",
    ]
    return " | ".join(parts) + " |"


def format_eval(prefix: str, losses: dict[str, float]) -> str:
    parts = []
    for name, value in losses.items():
        parts.append(f"{name} value: {value:.6E}")
        parts.append(f"{name} PPL: {math.exp(min(20.0, value)):.6E}")
    line = f" {prefix} | " + " | ".join(parts)
    bar = "-" * len(line)
    return f"{bar}\n{line}\n{bar}"


class TensorBoard:
    """A SummaryWriter on one rank; every call is a no-op elsewhere or without a directory."""

    def __init__(self, log_dir: Optional[str], enabled: bool, queue_size: int = 1000) -> None:
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: dict[str, Optional[float]], step: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(name, value, step)

    def text(self, name: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(name, text, 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()

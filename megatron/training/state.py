"""What a run carries between iterations (``TrainState``) and the sizes its rates divide by."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional

import torch.distributed as dist

from megatron.config import RunConfig
from megatron.core import parallel_state

# Iterations TrainState.history keeps: every one of the short runs tests and benchmarks make.
HISTORY_WINDOW = 1000


def _history() -> collections.deque:
    return collections.deque(maxlen=HISTORY_WINDOW)


@dataclasses.dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    best_valid_loss: float = math.inf
    last_saved: Optional[int] = None
    # Per iteration of this process: {"iteration", "losses", "grad_norm", "skipped",
    # "nonfinite", "loss_scale", "params_norm"}; what tests and benchmarks read instead of
    # parsing the log. Only the last HISTORY_WINDOW iterations: the loop itself reads only the
    # newest, and a run of a million steps must not hold a million entries.
    history: collections.deque = dataclasses.field(default_factory=_history)
    last_checkpoint: Optional[str] = None  # folder of the last checkpoint saved or resumed
    last_valid_losses: dict = dataclasses.field(default_factory=dict)


def data_parallel_size(cfg: RunConfig) -> int:
    """The run's data-parallel ranks: this process's data-parallel group's, times the XLA
    devices each process splits its micro-batches over (SPMD; else one)."""
    return parallel_state.get_data_parallel_world_size() * cfg.parallel.devices_per_process


def run_devices(cfg: RunConfig) -> int:
    """The devices of the run (what tokens and FLOP/s per GPU divide by): its processes,
    times the XLA devices of each under SPMD."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world * cfg.parallel.devices_per_process

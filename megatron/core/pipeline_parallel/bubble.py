"""The pipeline bubble: the share of an iteration a stage spends not computing.

Theory (equal stages, no communication cost, forward + backward time per micro-batch t):
with p stages and m micro-batches, 1F1B takes ``(m + p - 1) t`` of which ``(p - 1) t`` is
idle, a fraction ``(p - 1) / (m + p - 1)``. Interleaving v chunks per stage shrinks the idle
time v-fold, to ``(p - 1) t / v``, so the fraction of the iteration becomes
``(p - 1) / (v m + p - 1)`` (Narayanan et al., 2021, section 2.2; for v = 1 the same formula).

Measured: the schedules time each rank's forward and backward compute and its waits in
point-to-point exchanges (``schedules.FORWARD_TIMER`` etc.), and the training step times the
whole schedule call. The stages start an iteration together (the previous one ended in
collectives over all of them) but do not end together (the last stage finishes its last
backward ``p - 1`` backward steps before the first), so the iteration's pipeline time is the
longest stage's, and the bubble is ``1 - mean(compute) / max(schedule time)``: the same
quantity as the theory's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import BACKWARD_TIMER, FORWARD_TIMER, WAIT_TIMER

SCHEDULE_TIMER = "forward-backward"  # the training step's timer around the schedule call


def theoretical_bubble_fraction(pipeline_size: int, num_microbatches: int,
                                virtual_size: Optional[int] = None) -> float:
    """Idle share of an iteration in an ideal pipeline: ``(p - 1) / (v m + p - 1)``."""
    p, m, v = pipeline_size, num_microbatches, virtual_size or 1
    return (p - 1) / (v * m + p - 1)


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Seconds one stage spent in each part of the schedule (over any number of steps)."""

    forward: float
    backward: float
    wait: float
    total: float

    @classmethod
    def from_timings(cls, timings: Mapping[str, float]) -> StageTimes:
        return cls(timings.get(FORWARD_TIMER, 0.0), timings.get(BACKWARD_TIMER, 0.0),
                   timings.get(WAIT_TIMER, 0.0), timings.get(SCHEDULE_TIMER, 0.0))

    @property
    def compute(self) -> float:
        return self.forward + self.backward


def gather_stage_times(times: StageTimes, group=None) -> list[StageTimes]:
    """Every stage's times, in stage order (a collective over the pipeline group)."""
    if not dist.is_initialized():
        return [times]
    group = parallel_state.get_pipeline_model_parallel_group() if group is None else group
    mine = torch.tensor(dataclasses.astuple(times), dtype=torch.float64,
                        device=parallel_state.get_default_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [StageTimes(*t) for t in torch.stack(everyone).tolist()]


def measured_bubble_fraction(stages: Sequence[StageTimes]) -> float:
    """Idle share of the pipeline: ``1 - mean(compute) / max(schedule time)``."""
    span = max((s.total for s in stages), default=0.0)
    if span <= 0.0:
        return 0.0
    mean_compute = sum(s.compute for s in stages) / len(stages)
    return max(0.0, 1.0 - mean_compute / span)


def format_bubble(stages: Sequence[StageTimes], num_microbatches: int,
                  virtual_size: Optional[int] = None, iterations: int = 1) -> str:
    """One log line: measured vs theoretical bubble, and each stage's ms per iteration."""
    p = len(stages)
    theory = theoretical_bubble_fraction(p, num_microbatches, virtual_size)
    per_stage = " | ".join(
        f"stage {i}: fwd {1e3 * s.forward / iterations:.1f} bwd {1e3 * s.backward / iterations:.1f}"
        f" wait {1e3 * s.wait / iterations:.1f} ms"
        for i, s in enumerate(stages))
    return (f" pipeline bubble: measured {100 * measured_bubble_fraction(stages):.1f}% | "
            f"theoretical {100 * theory:.1f}% (p={p}, m={num_microbatches}, "
            f"v={virtual_size or 1}) | {per_stage}")

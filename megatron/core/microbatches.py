"""How many micro-batches make the current global batch (constant, or ramped up by samples)."""

from __future__ import annotations

from typing import Optional


class NumMicroBatchesCalculator:
    """Megatron's batch-size ramp-up: the global batch starts at ``start`` and grows by
    ``increment`` after each equal share of ``ramp_samples`` consumed samples, up to
    ``global_batch_size``. Without ramp-up the global batch is constant."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[tuple[int, int, int]] = None) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_times_dp = micro_batch_size * data_parallel_size
        self.rampup = rampup_batch_size
        self.current_global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if self.rampup is None:
            self.current_global_batch_size = self.global_batch_size
            return
        start, increment, ramp_samples = self.rampup
        steps = (self.global_batch_size - start) // increment
        if consumed_samples >= ramp_samples or steps == 0:
            self.current_global_batch_size = self.global_batch_size
            return
        samples_per_step = ramp_samples / steps
        self.current_global_batch_size = start + int(consumed_samples / samples_per_step) * increment

    @property
    def num_microbatches(self) -> int:
        return self.current_global_batch_size // self.micro_batch_times_dp

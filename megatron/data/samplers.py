"""Resumable batch samplers and the pre-training DataLoader.

A global batch of ``micro_batch_size * data_parallel_size`` consecutive sample indices is cut
into one micro-batch per data-parallel rank (rank r gets the r-th slice), as in Megatron.
Resuming from ``consumed_samples`` (saved in checkpoints) continues the same order.

DataLoader workers ignore SIGTERM (except their main process's) and SIGINT: torchrun and
SLURM signal every process on preemption, and the main process owns shutdown (it saves, then
stops its workers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, Optional

import torch

from megatron.data.dataset_utils import DataConfigError


def _check_common(total_samples: int, micro_batch_size: int, data_parallel_rank: int,
                  data_parallel_size: int) -> None:
    if total_samples <= 0:
        raise DataConfigError(f"no samples to consume: the dataset has {total_samples}")
    if micro_batch_size <= 0:
        raise DataConfigError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise DataConfigError(f"data-parallel rank {data_parallel_rank} outside "
                              f"[0, {data_parallel_size})")


class MegatronPretrainingSampler:
    """Sequential: yields this rank's micro-batch of each global window
    ``[consumed + k * mb * dp, consumed + (k + 1) * mb * dp)``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True
                 ) -> None:
        _check_common(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if not 0 <= consumed_samples < total_samples:
            raise DataConfigError(f"no samples left: consumed {consumed_samples} of "
                                  f"{total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _my_slice(self, window: list[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return window[start:start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield self._my_slice(list(range(start, start + step)))
            start += step
        if start < self.total_samples and not self.drop_last:
            tail = self._my_slice(list(range(start, self.total_samples)))
            if tail:
                yield tail


class MegatronPretrainingRandomSampler:
    """Megatron's 'cyclic' sampler: each epoch is a fresh permutation seeded by the epoch
    number (``torch.randperm``); resumes mid-epoch from ``consumed_samples``.

    Without ``data_sharding`` the permutation covers the whole dataset and ranks take strided
    samples; with it each rank permutes its own contiguous bucket.
    """

    def __init__(self, dataset: Any, total_samples: int, consumed_samples: int,
                 micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                 data_sharding: bool = True, seed: int = 0) -> None:
        _check_common(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.seed = seed
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise DataConfigError(f"{total_samples} samples cannot fill one global micro-batch "
                                  f"of {self.micro_batch_times_data_parallel_size}")

    def __len__(self) -> int:
        return self.total_samples

    def _epoch_order(self, epoch: int, done_in_epoch: int) -> list[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        if self.data_sharding:
            bucket = (self.total_samples // self.micro_batch_times_data_parallel_size
                      * self.micro_batch_size)
            first = self.data_parallel_rank * bucket
            order = torch.randperm(bucket, generator=g).tolist()
            return [first + x for x in order[done_in_epoch // self.data_parallel_size:]]
        full = self.total_samples // self.micro_batch_size * self.micro_batch_size
        order = torch.randperm(full, generator=g).tolist()[done_in_epoch:]
        return order[self.data_parallel_rank::self.data_parallel_size]

    def __iter__(self) -> Iterator[list[int]]:
        active = self.total_samples - self.last_batch_size
        epoch, done = divmod(self.consumed_samples, active)
        if done % self.micro_batch_times_data_parallel_size:
            raise DataConfigError(f"consumed samples {self.consumed_samples} is not a multiple "
                                  f"of micro-batch x data-parallel size")
        batch: list[int] = []
        for idx in self._epoch_order(epoch, done):
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def ignore_shutdown_signals(worker_id: int) -> None:
    """``worker_init_fn``: the worker leaves SIGTERM and SIGINT to its main process.

    A launcher's SIGTERM reaches the workers too; one that died of it would make the main
    process's next batch fail ("DataLoader worker ... killed by signal") before
    --exit-signal-handler could save. So SIGINT is ignored, and SIGTERM is blocked and read by
    a thread that obeys only the main process's own (``Process.terminate()``, which the
    DataLoader and multiprocessing's exit handler send to workers that did not stop): a worker
    that ignored those too would hang its main process at exit. A worker whose main process is
    gone exits by itself (PyTorch's worker watchdog).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # not Linux: no sender to tell apart
        return
    # Started with both blocked (see ``shutdown_signals_blocked``): a SIGTERM sent meanwhile
    # is still pending and is judged by the thread.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_obey_sigterm_from, args=(os.getppid(),), daemon=True,
                     name="sigterm-from-main-process").start()


def _obey_sigterm_from(main_process: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != main_process:
        pass
    # Quietly, with status 0, as PyTorch's own worker handler answers its main process: the
    # main process's SIGCHLD handler would report any other exit as a failed worker.
    os._exit(0)


@contextlib.contextmanager
def shutdown_signals_blocked():
    """Hold SIGTERM and SIGINT back from this thread while DataLoader workers start.

    Workers inherit the signal mask, so a SIGTERM that reaches one before its
    ``ignore_shutdown_signals`` ran waits there instead of killing it. This process gets its
    own held-back signals when the block ends.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ConsecutiveRanksSampler:
    """The micro-batches of consecutive data-parallel ranks, one after another in one batch
    (an XLA SPMD process feeds its devices, each a rank, one batch split along its rows)."""

    def __init__(self, samplers: list[Any]) -> None:
        self.samplers = samplers

    def __len__(self) -> int:
        return len(self.samplers[0])

    def __iter__(self) -> Iterator[list[int]]:
        for parts in zip(*self.samplers):
            yield [index for part in parts for index in part]


def build_pretraining_data_loader(dataset: Any, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 2, dataloader_type: str = "single",
                                  drop_last: bool = True, data_sharding: bool = True,
                                  seed: int = 0, pin_memory: bool = False,
                                  ranks_per_batch: int = 1
                                  ) -> Optional[torch.utils.data.DataLoader]:
    """A DataLoader yielding this data-parallel rank's micro-batches, or None for no dataset.

    ``dataloader_type`` is ``--dataloader-type``: 'single' (sequential over the already
    shuffled dataset) or 'cyclic' (re-permuted every epoch).
    ``pin_memory``: page-locked batches, which a GPU run copies to the device without
    blocking (the training loop asks for them on CUDA).
    ``ranks_per_batch``: each batch holds the micro-batches of this many consecutive
    data-parallel ranks from ``data_parallel_rank`` on, in rank order (XLA SPMD).
    """
    if dataset is None:
        return None
    if dataloader_type not in ("single", "cyclic"):
        raise DataConfigError(f"--dataloader-type {dataloader_type!r}: expected 'single' or "
                              "'cyclic'")
    samplers = [_rank_sampler(dataset, consumed_samples, micro_batch_size, rank,
                              data_parallel_size, dataloader_type, drop_last, data_sharding,
                              seed)
                for rank in range(data_parallel_rank, data_parallel_rank + ranks_per_batch)]
    batch_sampler = samplers[0] if ranks_per_batch == 1 else ConsecutiveRanksSampler(samplers)
    return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler,
                                       num_workers=num_workers, pin_memory=pin_memory,
                                       persistent_workers=num_workers > 0,
                                       worker_init_fn=ignore_shutdown_signals)


def _rank_sampler(dataset: Any, consumed_samples: int, micro_batch_size: int,
                  data_parallel_rank: int, data_parallel_size: int, dataloader_type: str,
                  drop_last: bool, data_sharding: bool, seed: int) -> Any:
    """One data-parallel rank's batch sampler for ``--dataloader-type``."""
    if dataloader_type == "single":
        return MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
            data_parallel_size, drop_last=drop_last)
    return MegatronPretrainingRandomSampler(
        dataset, len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
        data_parallel_size, data_sharding=data_sharding, seed=seed)

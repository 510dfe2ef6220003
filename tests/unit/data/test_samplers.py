import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron.data.dataset_utils import DataConfigError
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
    shutdown_signals_blocked,
)

from .corpus import random_lengths, write_corpus


def _sequential(total, consumed, mbs, dp, drop_last=True):
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last))
            for r in range(dp)]


def test_ranks_partition_each_global_batch_in_order():
    per_rank = _sequential(total=50, consumed=0, mbs=2, dp=3)
    assert all(len(b) == 8 for b in per_rank)  # 50 // 6 steps, last partial one dropped
    for step, batches in enumerate(zip(*per_rank)):
        assert sum(batches, []) == list(range(6 * step, 6 * step + 6))


def test_sequential_resume_gives_the_same_remaining_order():
    full = _sequential(total=50, consumed=0, mbs=2, dp=3)
    resumed = _sequential(total=50, consumed=18, mbs=2, dp=3)
    assert resumed == [b[3:] for b in full]


def test_sequential_keeps_partial_last_batch_when_asked():
    per_rank = _sequential(total=10, consumed=0, mbs=2, dp=2, drop_last=False)
    assert per_rank == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]


def test_sampler_argument_errors():
    with pytest.raises(DataConfigError, match="consumed 10 of 10"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(DataConfigError, match="rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)


def _random(total, consumed, mbs, dp, sharding):
    return [list(MegatronPretrainingRandomSampler(None, total, consumed, mbs, r, dp,
                                                  data_sharding=sharding))
            for r in range(dp)]


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_partitions_and_resumes(sharding):
    total, mbs, dp = 40, 3, 2
    full = _random(total, 0, mbs, dp, sharding)
    steps = list(zip(*full))
    assert len(steps) == total // (mbs * dp)
    seen = [i for step in steps for b in step for i in b]
    assert len(seen) == len(set(seen)) and max(seen) < total  # disjoint across ranks and steps
    resumed = _random(total, 2 * mbs * dp, mbs, dp, sharding)
    assert resumed == [b[2:] for b in full]
    # The next epoch is a different permutation.
    next_epoch = _random(total, total - total % (mbs * dp), mbs, dp, sharding)
    assert next_epoch != full


def test_data_loader_yields_this_ranks_micro_batches(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, random_lengths(30, 1, 40, seed=8))
    train, _, _ = build_train_valid_test_datasets([prefix], "mmap", "1", [40, 0, 0], 8, 3, True,
                                                  data_cache_path=str(tmp_path / "c"))
    loader = build_pretraining_data_loader(train, consumed_samples=4, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2,
                                           num_workers=0)
    batch = next(iter(loader))
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (2, 9)
    np.testing.assert_array_equal(batch["text"].numpy(), np.stack([train[6]["text"],
                                                                   train[7]["text"]]))
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
    with pytest.raises(DataConfigError, match="dataloader-type"):
        build_pretraining_data_loader(train, 0, 1, 0, 1, dataloader_type="x")


def _worker_loader(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, random_lengths(30, 1, 40, seed=8))
    train, _, _ = build_train_valid_test_datasets([prefix], "mmap", "1", [40, 0, 0], 8, 3, True,
                                                  data_cache_path=str(tmp_path / "c"))
    return train, build_pretraining_data_loader(train, 0, 2, 0, 1, num_workers=2)


def test_data_loader_workers_leave_sigterm_and_sigint_to_the_main_process(tmp_path):
    # torchrun and SLURM signal every process on preemption: a worker that died of it would
    # fail the main process's next batch ("DataLoader worker ... killed by signal") before
    # --exit-signal-handler could save.
    train, loader = _worker_loader(tmp_path)
    with shutdown_signals_blocked():
        batches = iter(loader)
    first = [next(batches)["text"] for _ in range(2)]  # one from each worker: both started
    workers = list(batches._workers)
    assert len(workers) == 2
    for worker in workers:  # from another process, as a launcher sends them
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
        subprocess.run(["kill", "-INT", str(worker.pid)], check=True)
    time.sleep(0.5)
    assert all(w.is_alive() for w in workers)
    rest = [b["text"] for b in batches]
    expected = [b["text"] for b in build_pretraining_data_loader(train, 0, 2, 0, 1,
                                                                 num_workers=0)]
    assert len(first + rest) == len(expected)
    for got, want in zip(first + rest, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_data_loader_workers_still_obey_their_main_process(tmp_path):
    # Process.terminate() is how the DataLoader and multiprocessing's exit handler stop
    # workers that did not stop by themselves; ignoring it would hang the main process.
    _, loader = _worker_loader(tmp_path)
    batches = iter(loader)
    next(batches)
    next(batches)
    for worker in batches._workers:
        worker.terminate()
        worker.join(timeout=10)
        assert worker.exitcode == 0  # as PyTorch's own handler answers its main process


CRASH_WITH_WORKERS = """
import sys
from megatron.data.samplers import build_pretraining_data_loader
loader = build_pretraining_data_loader([{"x": i} for i in range(40)], 0, 2, 0, 1,
                                       num_workers=2)
batches = iter(loader)
next(batches)
raise RuntimeError("boom")  # the traceback keeps the workers' iterator alive at exit
"""


def test_a_crash_with_live_workers_still_exits():
    done = subprocess.run([sys.executable, "-c", CRASH_WITH_WORKERS], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "RuntimeError: boom" in done.stderr


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_a_batch_of_consecutive_ranks_is_their_micro_batches_in_rank_order(dataloader_type):
    """An XLA SPMD process feeds 2 of 4 data-parallel ranks (its devices) one batch: ranks 2
    and 3's micro-batches, one after the other, resumed from the same consumed samples."""
    dataset = torch.arange(60)

    def loader(rank, ranks_per_batch=1):
        return list(build_pretraining_data_loader(
            dataset, 16, 2, rank, 4, num_workers=0, dataloader_type=dataloader_type, seed=3,
            ranks_per_batch=ranks_per_batch))

    together = loader(2, ranks_per_batch=2)
    apart = list(zip(loader(2), loader(3)))
    assert len(together) == len(apart) > 1
    for batch, (mine, next_rank) in zip(together, apart):
        assert batch.tolist() == mine.tolist() + next_rank.tolist()

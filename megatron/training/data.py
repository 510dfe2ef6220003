"""The run's data: samples each split must hold, datasets from the user's provider, and
iterators over this data-parallel rank's micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from megatron.assembly.build import RunContext
from megatron.checkpointing.ranks import all_true, first_failure
from megatron.config import RunConfig
from megatron.core import parallel_state
from megatron.data.dataset_utils import DataConfigError
from megatron.data.dataset_utils import train_valid_test_num_samples as data_sample_counts
from megatron.data.samplers import build_pretraining_data_loader, shutdown_signals_blocked
from megatron.platform.output import refuse
from megatron.training.state import TrainState, data_parallel_size


def train_valid_test_num_samples(cfg: RunConfig) -> list[int]:
    """[train, valid, test] samples the datasets must hold (the data layer's one formula)."""
    t = cfg.training
    return data_sample_counts(t.global_batch_size, t.eval_iters, t.eval_interval,
                              train_iters=t.train_iters, train_samples=t.train_samples)


def build_data_iterators(provider: Callable, ctx: RunContext, state: TrainState):
    """Iterators over this data-parallel rank's micro-batches for train, valid and test.

    Only the first and last pipeline stages read data (tokens and labels); others get None.
    """
    cfg = ctx.config
    needs_data = (parallel_state.is_pipeline_first_stage(ignore_virtual=True)
                  or parallel_state.is_pipeline_last_stage(ignore_virtual=True))
    datasets = _build_datasets_or_exit(provider if needs_data else None, ctx)
    if not needs_data:
        return None, None, None
    # Under XLA SPMD a process's micro-batch is its devices' (data-parallel ranks') ones.
    per_process = cfg.parallel.devices_per_process
    dp_rank = parallel_state.get_data_parallel_rank() * per_process
    dp_size = data_parallel_size(cfg)
    consumed = [state.consumed_train_samples, state.consumed_valid_samples, 0]
    iterators = []
    # Starting a DataLoader iterator draws a seed from torch's global generator, the one
    # dropout uses. A resumed run starts its iterators after restoring that generator, so
    # the draw would shift its random stream: keep the draw off it.
    with torch.random.fork_rng(devices=[]), shutdown_signals_blocked():
        for dataset, start in zip(datasets, consumed):
            loader = build_pretraining_data_loader(
                dataset, start, cfg.training.micro_batch_size, dp_rank, dp_size,
                num_workers=cfg.data.num_workers, dataloader_type=cfg.data.dataloader_type,
                seed=cfg.training.seed, pin_memory=ctx.device.type == "cuda",
                ranks_per_batch=per_process)
            iterators.append(iter(loader) if loader is not None else None)
    return tuple(iterators)


def _build_datasets_or_exit(provider: Optional[Callable], ctx: RunContext):
    """The provider's datasets (None: this rank builds none). A data error met while they
    are built (a full --data-cache-path) ends every rank with one ``error:`` line, as the
    start-up checks do; collective over all ranks."""
    datasets, error = None, None
    if provider is not None:
        try:
            datasets = provider(ctx, train_valid_test_num_samples(ctx.config))
        except DataConfigError as e:
            error = e
    if not all_true(error is None):
        refuse(first_failure(error)[1])
    return datasets

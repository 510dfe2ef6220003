"""Start-up checks: bad flags, data, tokenizer files, checkpoint folders, a resumed schedule
that does not match, XLA device support, and the --save lock end the run with one
``error: ...`` line (global rank 0) and status 2 before any model exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.assembly.build import build_run_tokenizer
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.folder import DEEPSPEED, MEGATRON
from megatron.checkpointing.load import checkpoint_model_settings
from megatron.checkpointing.lock import SaveLock
from megatron.checkpointing.ranks import broadcast_from_rank0
from megatron.config import ConfigError, RunConfig, parse_args
from megatron.core.optimizer_param_scheduler import (
    ScheduleMismatchError,
    build_optimizer_param_scheduler,
)
from megatron.data.checks import check_training_data
from megatron.data.dataset_utils import DataConfigError
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.platform.output import print_rank_0, refuse
from megatron.tokenizer import TokenizerConfigError
from megatron.training import xla_step
from megatron.training.data import train_valid_test_num_samples


def check_run_inputs(cfg: RunConfig):
    """The run's tokenizer, built and checked with the data files before any process group or
    model exists: bad input ends the run with ``error: ...`` naming the flag or file, and
    status 2. Returns the tokenizer (None for --mock-data without tokenizer files)."""
    try:
        tokenizer = build_run_tokenizer(cfg)
        samples = train_valid_test_num_samples(cfg)
        check_training_data(cfg.data, tokenizer.vocab_size if tokenizer is not None else None,
                            samples[0], cfg.model.seq_length, (samples[1], samples[2]))
    except (TokenizerConfigError, DataConfigError, IndexedDatasetError) as error:
        refuse(str(error))
    return tokenizer

def with_xla_spmd_or_exit(cfg: RunConfig, argv: Optional[list[str]],
                           extra_args_provider: Optional[Callable],
                           args_defaults: Optional[dict]) -> RunConfig:
    """``cfg``, or where this process trains several XLA devices with SPMD
    (``xla_step.spmd_devices``) the flags read again with each device a data-parallel
    rank, so that the batch sizes are Megatron's (--micro-batch-size per device, a
    --global-batch-size left out defaulting to it times the devices). Batch sizes the
    devices cannot split end the run with ``error: ...`` naming the flags."""
    devices = xla_step.spmd_devices(cfg)
    if devices is None:
        return cfg
    try:
        return parse_args(argv, extra_args_provider, defaults=args_defaults,
                          xla_spmd_devices=devices, announce=False,
                          checkpoint_settings=checkpoint_model_settings)
    except ConfigError as error:
        refuse(f"XLA SPMD over {devices} devices (--xla-spmd; each device is a data-parallel "
                f"rank): {error}")

def check_device_support_or_exit(cfg: RunConfig, replica: bool = False) -> None:
    """Flags an XLA device cannot honour, XLA-only flags without one and (``replica``) an XLA
    world PJRT cannot make end the run with ``error: ...`` naming the flag (exit 2) before
    any process group or model exists (``megatron.training.xla_step``)."""
    if replica and cfg.parallel.xla_spmd_devices:
        return  # one process, every device its own (xla_step.spmd_devices)
    if replica:
        problem = xla_step.unsupported_replica(cfg)
    elif cfg.training.distributed_backend == "xla":
        problem = xla_step.unsupported_on_xla(cfg)
    else:
        problem = xla_step.unsupported_off_xla(cfg)
    if problem is not None:
        refuse(problem)

def check_checkpoint_folders_or_exit(cfg: RunConfig) -> None:
    """A --load that is a file and a --save that cannot be written are user errors: say so
    (``error: ...``, exit 2) before any process group or model exists."""
    try:
        if cfg.checkpoint.load:
            checkpointing.check_load_dir(cfg.checkpoint.load, cfg.deepspeed.deepspeed,
                                         cfg.checkpoint.universal_checkpoint)
        if cfg.checkpoint.save:
            checkpointing.check_save_dir(cfg.checkpoint.save)
    except checkpointing.CheckpointError as error:
        refuse(str(error))

def lock_save_folder_or_exit(cfg: RunConfig):
    """Global rank 0 locks --save for this run (megatron/checkpointing/lock.py); a folder
    another live run saves into ends every rank with ``error: ...`` (rank 0) and status 2,
    before the model is built. Returns the lock (rank 0), else None."""
    if not cfg.checkpoint.save:
        return None
    lock, problem = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        lock = SaveLock(cfg.checkpoint.save)
        try:
            lock.acquire()
        except (CheckpointError, OSError) as error:
            lock, problem = None, str(error)
    problem = broadcast_from_rank0(problem)
    if problem is not None:
        refuse(problem)
    return lock

def warn_slow_precision(cfg: RunConfig, device: torch.device) -> None:
    if device.type == "cpu" and (cfg.optimizer.bf16 or cfg.optimizer.fp16):
        print_rank_0(
            "WARNING: --bf16/--fp16 on a CPU: most CPUs have no fast half-precision matmul, "
            "and on an AVX2-only CPU bf16 ran about 35x slower than fp32 (13 vs 490 tokens/s "
            "for a 30M-parameter GPT). Use fp32 on CPU unless you are testing precision.")

class _NoParameters:
    """An optimizer without parameters: what a scheduler built only to be compared needs."""

    param_groups: list = []

def check_resumed_schedule_or_exit(cfg: Any, ds_config: Optional[dict]) -> None:
    """A ``--load`` whose schedule differs from this run's flags (another --lr, a longer
    --train-iters that moves the decay) ends the run before any process group or model
    exists: ``error: ...`` on rank 0 naming each value, its flags and the flag that resolves
    it (exit status 2), instead of a ``ScheduleMismatchError`` on every rank at the load. The
    same rule as the load: a scheduler built from the flags loads the checkpoint's state."""
    ck, sc = cfg.checkpoint, cfg.scheduler
    if (not ck.load or ck.finetune or ck.no_load_optim or ck.no_load_lr_state
            or sc.override_opt_param_scheduler or sc.use_checkpoint_opt_param_scheduler
            or (ds_config is not None and "scheduler" in ds_config)):
        return
    # --deepspeed resumes DeepSpeed's checkpoints, whose client state holds our schedule.
    found = checkpointing.load_scheduler_state(
        ck.load, DEEPSPEED if ds_config is not None else MEGATRON, ck.universal_checkpoint)
    if found is None:
        return
    folder, saved = found
    scheduler = build_optimizer_param_scheduler(
        sc, cfg.optimizer, _NoParameters(), global_batch_size=cfg.training.global_batch_size,
        train_iters=cfg.training.train_iters, train_samples=cfg.training.train_samples)
    try:
        scheduler.load_state_dict(saved)
    except ScheduleMismatchError as error:
        refuse(f"--load {ck.load}: {folder}: {error}")

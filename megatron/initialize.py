"""Process start-up: torch.distributed from the launcher's environment, groups, and seeds.

Launchers set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun, the
deepspeed launcher, ``torch.distributed.launch``); under SLURM's ``srun`` the SLURM_* variables
stand in. A plain ``python pretrain_gpt.py`` runs as a world of one.
"""

from __future__ import annotations

import atexit
import datetime
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.run_config import RunConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env() -> dict[str, int]:
    """rank, world_size and local_rank from the launcher's environment (1 process if none)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return dict(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                    local_rank=int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return dict(rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
                    local_rank=int(env.get("SLURM_LOCALID", 0)))
    return dict(rank=0, world_size=1, local_rank=0)


def initialize_distributed(backend: str, timeout_minutes: int = 10) -> None:
    """Join the process group (if not joined yet) and pick this process's device."""
    if dist.is_initialized():
        return
    info = distributed_env()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs CUDA; use gloo on CPU")
        torch.cuda.set_device(info["local_rank"] % torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if info["world_size"] > 1:
            raise RuntimeError("MASTER_PORT is not set: launch with torchrun, deepspeed or srun")
        os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group(backend, rank=info["rank"], world_size=info["world_size"],
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    atexit.register(_destroy_process_group_at_exit)


def _destroy_process_group_at_exit() -> None:
    """Tear down the groups this process joined while the interpreter is still whole: a
    process that exits with gloo's worker threads running can abort at shutdown ("terminate
    called without an active exception", exit status -6) after a clean run."""
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def set_random_seeds(seed: int) -> None:
    """Python, numpy and torch seeds, the same on every rank of a pipeline stage; the
    tensor-parallel tracker gets a per-tensor-rank stream (see tensor_parallel.random)."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    model_parallel_seed(seed)


def initialize_megatron(config: RunConfig) -> None:
    """torch.distributed, the model-parallel groups and the random seeds for this run."""
    initialize_distributed(config.training.distributed_backend,
                           config.training.distributed_timeout_minutes)
    world = dist.get_world_size()
    if world != config.parallel.world_size:
        raise RuntimeError(
            f"the launcher started {world} processes but the configuration was validated for "
            f"{config.parallel.world_size} (WORLD_SIZE)")
    p = config.parallel
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size)
    set_random_seeds(config.training.seed)

"""Process start-up: torch.distributed from the launcher's environment, groups, and seeds.

Launchers set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun, the
deepspeed launcher, ``torch.distributed.launch``); under SLURM's ``srun`` the SLURM_* variables
stand in, and the rendezvous is the first host of the job's node list (``megatron.platform.slurm``).
A plain ``python pretrain_gpt.py`` runs as a world of one.
"""

from __future__ import annotations

import atexit
import datetime
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.config import RunConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.platform import launcher_watch, rendezvous, xla
from megatron.platform.device import compute_device, describe
from megatron.platform.launch_env import (
    distributed_env,
    free_port,
    nccl_error_handling_env,
    parent_env,
    rendezvous_env,
)
from megatron.platform.output import print_rank_0


def initialize_distributed(backend: str, timeout_minutes: float = 10,
                           device: Optional[torch.device] = None, xla_spmd: bool = False
                           ) -> None:
    """Join the process group (if not joined yet) on this process's ``device``.

    ``backend`` and ``device`` come from ``megatron.platform.device`` (one place decides them). NCCL
    is bound to the device at start-up (``device_id``), so its communicators and barriers use
    that GPU from the first call. Under torchrun the ranks meet in the agent's store under a
    key of this attempt's own, so that a restarted attempt never reads a dead one's addresses
    (``megatron.platform.rendezvous``).
    ``xla_spmd``: this process trains its XLA devices with SPMD (``megatron.platform.xla``), the run's
    one rank.
    """
    launcher_watch.stop_with_launcher()  # tools that start here (pretrain() did already)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    if backend == "xla":
        _initialize_xla_distributed(timeout_minutes, xla_spmd)
        return
    info = distributed_env()
    if backend == "nccl" and (device is None or device.type != "cuda"):
        raise RuntimeError("--distributed-backend nccl needs a CUDA device")
    os.environ.update(rendezvous_env(os.environ))
    if backend == "nccl":  # read when the NCCL group is made
        os.environ.update(nccl_error_handling_env(os.environ, parent_env()))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    extra = {"device_id": device} if backend == "nccl" else {}
    if rendezvous.uses_agent_store(os.environ):
        extra["store"] = rendezvous.attempt_store(info["rank"], info["world_size"], timeout)
    dist.init_process_group(backend, rank=info["rank"], world_size=info["world_size"],
                            timeout=timeout, **extra)
    atexit.register(_destroy_process_group_at_exit)


def _initialize_xla_distributed(timeout_minutes: float, spmd: bool) -> None:
    """The XLA replicas' group (``megatron.platform.xla``): ranks and world from torch_xla's runtime
    (under SPMD one rank), the rendezvous at MASTER_ADDR/MASTER_PORT (a free port for a
    world of one)."""
    rank, world_size = xla.world()
    env = {"MASTER_ADDR": os.environ.get("MASTER_ADDR") or "127.0.0.1"}
    if os.environ.get("MASTER_PORT"):
        env["MASTER_PORT"] = os.environ["MASTER_PORT"]
    elif world_size > 1:
        raise RuntimeError("MASTER_PORT is not set: launch with --xla-processes or torchrun")
    else:
        env["MASTER_PORT"] = str(free_port())
    if world_size > 1 and xla.runs_a_thread_per_device():
        raise RuntimeError(xla.THREADS_REFUSED)
    os.environ.update(env)
    parallel_state.set_control_group(xla.init_process_group(timeout_minutes, spmd))
    atexit.register(_destroy_process_group_at_exit)


def _destroy_process_group_at_exit() -> None:
    """Tear down the groups this process joined while the interpreter is still whole: a
    process that exits with gloo's worker threads running can abort at shutdown ("terminate
    called without an active exception", exit status -6) after a clean run."""
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.set_control_group(None)
        dist.destroy_process_group()


def set_random_seeds(seed: int) -> None:
    """Python, numpy and torch seeds, the same on every rank of a pipeline stage; the
    tensor-parallel tracker gets a per-tensor-rank stream (see tensor_parallel.random)."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    model_parallel_seed(seed)


def _check_existing_group(device: torch.device) -> None:
    """A caller that made the process group first (a test, an embedding program) must have
    made it for this device: NCCL carries only CUDA tensors."""
    if dist.get_backend() == "nccl" and device.type != "cuda":
        raise RuntimeError(
            "the process group was initialized with nccl, but this run computes on the CPU "
            "(--use-cpu, or no GPU visible): initialize it with gloo")


def _set_cuda_max_connections(config: RunConfig, device: torch.device) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 under sequence parallelism, as Megatron requires it there,
    so that kernels reach the GPU in the order they were issued (a communication kernel ahead
    of the GEMM that needs it). It must be set before the CUDA context exists; a value the
    user set is kept."""
    if device.type == "cuda" and config.parallel.sequence_parallel:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _set_deterministic(config: RunConfig) -> None:
    """--deterministic-mode: kernels without run-to-run variation (CUDA atomics in index_add_
    and scatter_add_ become sorted reductions; cuBLAS gets a fixed workspace)."""
    if config.training.deterministic_mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def initialize_megatron(config: RunConfig) -> torch.device:
    """The device, torch.distributed, the model-parallel groups and the random seeds for
    this run; returns the device (also recorded in ``parallel_state``)."""
    t = config.training
    device = compute_device(t.use_cpu, distributed_env()["local_rank"], t.device)
    _set_cuda_max_connections(config, device)
    _set_deterministic(config)
    spmd_devices = config.parallel.xla_spmd_devices
    initialize_distributed(t.distributed_backend, t.distributed_timeout_minutes, device,
                           xla_spmd=spmd_devices is not None)
    _check_existing_group(device)
    world = dist.get_world_size()
    if world != config.parallel.world_size:
        raise RuntimeError(
            f"the launcher started {world} processes but the configuration was validated for "
            f"{config.parallel.world_size} (WORLD_SIZE)")
    parallel_state.set_default_device(device)
    p = config.parallel
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size, context_parallel_size=p.context_degree,
            expert_model_parallel_size=p.expert_model_parallel_size,
            distributed_timeout_minutes=t.distributed_timeout_minutes)
    set_random_seeds(t.seed)
    if device.type == "xla":  # dropout there draws from the device's own generator
        xla.set_rng_state(t.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    print_rank_0(describe(device, dist.get_backend(), t.use_cpu, spmd_devices))
    restarts = rendezvous.restart_count(os.environ)
    if restarts:
        print_rank_0(f"> torchrun restarted the workers ({restarts} of --max-restarts "
                     f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} on this node); this "
                     "attempt's ranks met under a key of their own")
    return device

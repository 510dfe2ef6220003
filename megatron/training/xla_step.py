"""The training step on an XLA device, and what an XLA run refuses at start-up.

``train_step`` is ``NativeEngine.train_step`` (megatron.training.engines) shaped for a traced
device: forward and backward over the micro-batches, the data-parallel gradient average, the NaN/Inf check,
clipping and the optimizer update (``MegatronOptimizer.step_on_device``) are all traced
into one graph without reading a device value; ``mark_step`` ends it once per iteration,
and the values the log needs (the reduced losses, the gradient norm, whether the step was
skipped) reach the host in a step closure after the graph ran. Shapes do not change from one
iteration to the next and the learning rate reaches the graph as data, so after the first
iterations no graph is compiled again (``xla_compilations`` in each history entry, and the
count at the end of the run, come from torch_xla's metrics).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.config import RunConfig
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.nonfinite import (
    decode_nonfinite_loss_key,
    describe_nonfinite_loss,
    nonfinite_loss_found,
    nonfinite_loss_key,
)
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.platform import xla


class DeviceStep(NamedTuple):
    losses: dict[str, float]
    updated: bool
    grad_norm: Optional[float]
    nonfinite: Optional[str]


def unsupported_on_xla(cfg: RunConfig) -> Optional[str]:
    """Why this run cannot train on an XLA device (naming the flag), or None."""
    p, o, t = cfg.parallel, cfg.optimizer, cfg.training
    refusals = [
        (p.tensor_model_parallel_size > 1, "--tensor-model-parallel-size > 1 (tensor "
         "parallelism is not tested over the xla backend)"),
        (p.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1 (the xla "
         "backend has no point-to-point send/recv)"),
        (cfg.deepspeed.deepspeed, "--deepspeed (DeepSpeed's engine has no XLA accelerator)"),
        (o.fp16, "--fp16 (its dynamic loss scale is a host decision; use --bf16)"),
        (o.loss_scale is not None, "--loss-scale (bf16 and fp32 need none)"),
        (o.use_distributed_optimizer, "--use-distributed-optimizer"),
        (o.overlap_grad_reduce, "--overlap-grad-reduce (the graph schedules the reduction)"),
        (o.log_num_zeros_in_grad, "--log-num-zeros-in-grad"),
        (o.optimizer == "accumadamw", "--optimizer accumadamw"),
        (p.dp_mode != "allreduce", "--dp-mode decentralized"),
        (t.compile, "--compile (an XLA step is compiled by XLA)"),
        (cfg.checkpoint.ckpt_format == "torch_dist", "--ckpt-format torch_dist "
         "(torch.distributed.checkpoint's collectives do not run over the xla backend; the "
         "torch format's checkpoints load on any device)"),
    ]
    for refused, what in refusals:
        if refused:
            return f"an XLA device cannot train with {what}"
    return unsupported_launch(cfg)


def unsupported_launch(cfg: RunConfig) -> Optional[str]:
    """Why ``--xla-processes``/``--xla-spmd`` cannot start this run on this host, or None."""
    t = cfg.training
    processes = t.xla_processes
    if t.xla_spmd and processes:
        return (f"--xla-spmd trains every device of this host in one process: it cannot be "
                f"combined with --xla-processes {processes} (give 0, or leave it out)")
    if t.xla_spmd and cfg.parallel.world_size > 1:
        return (f"--xla-spmd with {cfg.parallel.world_size} processes (WORLD_SIZE): SPMD over "
                "several processes or hosts is not supported; run one process (the devices "
                "of one host), or one process per device without --xla-spmd")
    if processes and processes > 1 and xla.host_runs_a_thread_per_device():
        return f"--xla-processes {processes}: {xla.THREADS_REFUSED}"
    return None


def launches_replicas(cfg: RunConfig) -> bool:
    """Whether this process starts the run's replicas through ``torch_xla.launch``: for
    ``--xla-processes``, unless every device of the host trains here with SPMD instead
    (``--xla-processes 0`` where the devices would be threads of one process, or with
    ``--xla-spmd``), and unless this process is a replica already."""
    t = cfg.training
    if t.xla_processes is None or xla.inside_replica():
        return False
    if t.xla_processes == 0 and (t.xla_spmd or (t.xla_spmd is None
                                                and xla.host_runs_a_thread_per_device())):
        return False
    return True


def spmd_devices(cfg: RunConfig) -> Optional[int]:
    """The devices this process trains over with SPMD, SPMD turned on; or None (no SPMD).
    With ``--xla-spmd`` unset, SPMD is on where this process is the run's only one and
    addresses several devices (which otherwise would idle). Starts torch_xla's runtime (in
    SPMD mode) when SPMD is on."""
    t = cfg.training
    if t.distributed_backend != "xla" or t.xla_spmd is False:
        return None
    if not t.xla_spmd and (cfg.parallel.world_size > 1 or t.xla_processes
                           or xla.devices_of_a_process() < 2):
        return None
    return xla.use_spmd()


def unsupported_replica(cfg: RunConfig) -> Optional[str]:
    """Why this process cannot be one replica of an XLA run (its world must be PJRT's, one
    device per process), or None. Starts torch_xla's runtime."""
    if cfg.training.distributed_backend != "xla":
        return None
    world = cfg.parallel.world_size
    if world > 1 and xla.runs_a_thread_per_device():
        return xla.THREADS_REFUSED
    pjrt_world = xla.world()[1]
    if pjrt_world != world:
        return (f"the launcher started {world} processes (WORLD_SIZE) but PJRT "
                f"({xla.PJRT_ENV}={os.environ.get(xla.PJRT_ENV)}) joins {pjrt_world} device(s) "
                "into this run: each process must be one device of it (PJRT_DEVICE=CPU "
                "cannot join processes; one process per device needs TPUs or GPUs)")
    return None


def unsupported_off_xla(cfg: RunConfig) -> Optional[str]:
    """Why this run's XLA-only flags do not apply (no XLA device), or None."""
    if cfg.optimizer.use_syncfree_optim:
        return ("--use-syncfree-optim is torch_xla's optimizer: it needs an XLA device "
                "(--device xla, or PJRT_DEVICE with torch_xla installed)")
    if cfg.training.xla_processes is not None:
        return ("--xla-processes starts XLA replicas: it needs an XLA device (--device xla, or "
                "PJRT_DEVICE with torch_xla installed)")
    if cfg.training.xla_spmd:
        return ("--xla-spmd splits the batch over XLA devices: it needs an XLA device (--device "
                "xla, or PJRT_DEVICE with torch_xla installed)")
    return None


def split_over_devices(forward_step: Callable, devices: int) -> Callable:
    """``forward_step`` with its loss taken as data parallelism takes it where one process
    trains ``devices`` XLA devices with SPMD: the micro-batch holds each device's rows one
    after another (``RunContext.batch_to_device``), and the loss is the mean of each device's
    own loss, as separate data-parallel ranks' gradients average; ``devices`` 1: as it is."""
    if devices == 1:
        return forward_step

    @functools.wraps(forward_step)  # the schedule reads its signature (``stage``)
    def step(*args, **kwargs):
        output, loss_func = forward_step(*args, **kwargs)
        return output, functools.partial(mean_of_devices, loss_func, devices)

    return step


def mean_of_devices(loss_func: Callable, devices: int, output: torch.Tensor):
    """``loss_func``'s loss and reported values as the mean over ``devices`` of each device's
    rows of ``output`` ``[b, ...]`` alone. ``loss_func`` is a weighted mean of its input (as
    ``masked_mean_loss`` is): given ``output`` with the other devices' rows zeroed it gives
    this device's weighted sum over all the weight, and given this device's rows of ones
    its share of the weight; their ratio is this device's own mean."""
    rows = output.size(0) // devices
    device_of_row = torch.arange(output.size(0), device=output.device) // rows  # [b]
    losses, reported = [], []
    for d in range(devices):
        keep = (device_of_row == d).to(output.dtype).view(-1, *[1] * (output.dim() - 1))
        keep = keep.expand_as(output)
        share = loss_func(keep)[0].detach()  # [] this device's weight / all the weight
        loss, values = loss_func(output * keep)
        losses.append(loss / share)
        reported.append({name: value / share for name, value in values.items()})
    mean = torch.stack(losses).mean()
    return mean, {name: torch.stack([r[name] for r in reported]).mean() for name in reported[0]}


def _reduce_losses(losses: list[dict[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Names and their values averaged over micro-batches and data-parallel ranks, as a
    device tensor (``megatron.training.engines.reduce_losses`` without the host read)."""
    names = sorted({name for d in losses for name in d})
    device = parallel_state.get_default_device()
    values = torch.stack([torch.stack([d[n].detach().float() for d in losses]).mean()
                          for n in names]) if names else torch.zeros(0, device=device)
    if dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1:
        values = values / parallel_state.get_data_parallel_world_size()
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    return names, values


def train_step(forward_step: Callable, data_iterator, chunks, optimizer, cfg: RunConfig,
               num_microbatches: int, timers) -> DeviceStep:
    """One iteration traced into one graph and run; see the module docstring."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    timers("forward-backward", log_level=1).start()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=chunks,
        num_microbatches=num_microbatches, seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.training.micro_batch_size, grad_scale_func=optimizer.scale_loss,
        timers=timers)
    timers("forward-backward").stop()
    timers("grads-reduce", log_level=1).start()
    finalize_model_grads(chunks)
    timers("grads-reduce").stop()
    timers("optimizer", log_level=1).start()
    check = cfg.optimizer.check_for_nan_in_loss_and_grad
    # Over the device's data-parallel group: tensor and pipeline parallelism are refused on
    # XLA, so it holds every rank (the default group, gloo, carries no XLA tensor).
    loss_key = (nonfinite_loss_key(losses, parallel_state.get_data_parallel_group()) if check
                else None)
    loss_bad = None if loss_key is None else nonfinite_loss_found(loss_key)
    skipped, grad_norm = optimizer.step_on_device(loss_bad)
    names, values = _reduce_losses(losses)
    read: dict = {}
    xla.add_step_closure(_read_step, (read, values, skipped, grad_norm, loss_key))
    xla.mark_step()
    timers("optimizer").stop()
    reduced = dict(zip(names, read["values"]))
    nonfinite = None
    if read["skipped"]:
        where = decode_nonfinite_loss_key(read["loss_key"]) if read["loss_key"] is not None \
            else None
        nonfinite = (describe_nonfinite_loss(*where, num_microbatches) if where is not None
                     else f"the grad norm ({read['grad_norm']})")
    return DeviceStep(reduced, not read["skipped"], read["grad_norm"], nonfinite)


def _read_step(read: dict, values: torch.Tensor, skipped: torch.Tensor,
               grad_norm: Optional[torch.Tensor], loss_key: Optional[torch.Tensor]) -> None:
    """The step closure: the step's values, on the host once its graph has run."""
    read["values"] = values.cpu().double().tolist()
    read["skipped"] = bool(skipped.cpu().item() > 0)
    read["grad_norm"] = None if grad_norm is None else float(grad_norm.cpu().reshape(()))
    read["loss_key"] = None if loss_key is None else int(loss_key.cpu().reshape(()))


def record_compilations(entry: dict) -> None:
    """Add the graphs compiled and run so far to a history entry (``xla_compilations``,
    ``xla_executions``)."""
    entry["xla_compilations"] = xla.compilations()
    entry["xla_executions"] = xla.executions()


def compilation_report() -> str:
    """The end-of-run line: how many graphs were compiled and run."""
    return (f"> XLA: {xla.compilations()} graph compilations and {xla.executions()} graph "
            "executions in this run (torch_xla metrics CompileTime, ExecuteTime or "
            "ExecuteReplicatedTime)")

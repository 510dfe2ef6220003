"""Step engines: what one training iteration, one evaluation iteration, a save and a load are
for the engine that trains (``StepEngine``). The loop (``megatron.training.loop``) calls these
and nothing engine-specific:

- ``NativeEngine``: our schedules (1F1B, interleaved), gradient reduction and optimizer;
- ``XlaEngine``: the same, as one traced graph per iteration on an XLA device
  (``megatron.training.xla_step``);
- ``DeepSpeedEngine``: DeepSpeed's engine (``megatron.integrations.deepspeed.DeepSpeedRun``),
  which replaces the schedule, the step and the checkpoint files.

A step reports a ``StepResult``; the learning-rate schedule advances in the loop, once per
applied step, whatever the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.assembly.build import RunContext
from megatron.checkpointing.formats.deepspeed.universal import load_universal_checkpoint
from megatron.checkpointing.formats.deepspeed.universal_folder import find_universal
from megatron.config import RunConfig
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.nonfinite import (
    check_finite_for_save,
    describe_nonfinite_grad_norm,
    describe_nonfinite_loss,
    locate_nonfinite_loss,
)
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func, takes_stage
from megatron.model.moe import record_reported as record_moe_losses
from megatron.model.moe import reported_names as moe_reported_names
from megatron.model.moe import routing_figures as moe_routing_figures
from megatron.model.moe import set_loss_scale as set_moe_loss_scale
from megatron.model.moe import take_step_routing as take_moe_step_routing
from megatron.model.moe import take_step_totals as take_moe_step_totals
from megatron.model.moe import update_expert_biases
from megatron.platform import xla
from megatron.platform.output import print_rank_0
from megatron.training import xla_step
from megatron.training.log import format_load_report
from megatron.training.state import TrainState, data_parallel_size


class StepResult(NamedTuple):
    losses: dict[str, float]  # reduced over micro-batches and data-parallel ranks
    skipped: bool  # no update applied (fp16 overflow or a non-finite step)
    grad_norm: Optional[float]
    num_zeros: Optional[int]
    nonfinite: Optional[str]  # what was NaN/Inf when the guard skipped the step, else None


class StepEngine(Protocol):
    """One engine's iteration, evaluation, save and load (see the module docstring)."""

    chunks: list  # this rank's model chunks
    optimizer: Any
    scheduler: Any  # ours, or None where the engine's JSON brings its own
    records_best: bool  # save() records a --save-best checkpoint's validation loss itself

    def train_step(self, data_iterator, num_microbatches: int) -> StepResult:
        """Forward and backward over the micro-batches and the optimizer step."""

    def eval_losses(self, data_iterator, num_microbatches: int) -> list[dict]:
        """One forward-only iteration: its micro-batches' loss dicts (last stage)."""

    def save(self, state: TrainState, valid_loss: Optional[float], saver: Any) -> str:
        """This iteration's checkpoint (every rank); returns its folder."""

    def load(self, state: TrainState, cfg: RunConfig) -> None:
        """``cfg.checkpoint.load``'s latest checkpoint into the engine and ``state``."""


def build_engine(ctx: RunContext, forward_step: Callable, chunks: list, optimizer: Any,
                 scheduler: Any, deepspeed_run: Any = None) -> StepEngine:
    """The engine of this run: DeepSpeed's where ``deepspeed_run`` is given, else ours (on an
    XLA device, its traced form)."""
    if deepspeed_run is not None:
        return DeepSpeedEngine(deepspeed_run, forward_step, ctx)
    if ctx.device.type == "xla":
        return XlaEngine(forward_step, chunks, optimizer, scheduler, ctx)
    return NativeEngine(forward_step, chunks, optimizer, scheduler, ctx)


def reduce_losses(losses: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Mean over micro-batches here, then over data-parallel ranks; sent from the last
    pipeline stage to every rank of its pipeline group."""
    names = sorted({name for d in losses for name in d}) if losses else []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # Other stages do not know the names: the last stage's list is canonical.
        names = [names]
        dist.broadcast_object_list(names, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        names = names[0]
    # On the compute device: NCCL carries nothing else. One host copy at the end.
    device = parallel_state.get_default_device()
    values = torch.zeros(len(names), dtype=torch.float64, device=device)
    if losses:
        for i, name in enumerate(names):
            values[i] = torch.stack([d[name].detach().to(device, torch.float64)
                                     for d in losses]).mean()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        values.zero_()
    # Groups of one are skipped: under XLA SPMD the one rank's group is gloo, which carries
    # no XLA tensor (its devices' losses are averaged inside the graph).
    # Over the context-parallel ranks too: each reports its share of the loss times their
    # count (gpt_batch.masked_mean_loss), so the mean is the whole sequences' loss.
    dp_size = (parallel_state.get_data_parallel_world_size(with_context_parallel=True)
               if dist.is_initialized() else 1)
    if dp_size > 1:
        values /= dp_size
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    if device.type == "xla":  # run the traced evaluation step before reading it
        xla.mark_step()
    return dict(zip(names, values.tolist()))


def sum_over_routing_ranks(counts: torch.Tensor) -> None:
    """Sum ``counts`` in place over every rank that routed tokens of the step: the data-
    parallel (with context) and tensor-parallel ranks (megatron-core's TP x CP x DP group)."""
    if not dist.is_initialized():
        return
    for group, size in ((parallel_state.get_data_parallel_group(with_context_parallel=True),
                         parallel_state.get_data_parallel_world_size(with_context_parallel=True)),
                        (parallel_state.get_tensor_model_parallel_group(),
                         parallel_state.get_tensor_model_parallel_world_size())):
        if size > 1:
            dist.all_reduce(counts, group=group)


def router_losses(chunks: list, config: Any) -> dict[str, float]:
    """The mixture-of-experts router losses of the step (recorded per micro-batch): each
    layer's mean over the micro-batches, averaged over the layers of every pipeline stage,
    then over the data-parallel ranks (each routes its own tokens); and how the tokens spread
    over the experts (``expert_loads``). Every rank calls it."""
    if config.num_experts is None:
        return {}
    names = moe_reported_names(config)
    totals = take_moe_step_totals(chunks)
    device = parallel_state.get_default_device()
    sums = torch.zeros(2, len(names), dtype=torch.float64, device=device)  # [total; layers]
    for i, name in enumerate(names):
        if name in totals:
            value, layers = totals[name]
            sums[0, i], sums[1, i] = float(value), layers
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
    values = sums[0] / sums[1].clamp(min=1)
    dp_size = (parallel_state.get_data_parallel_world_size(with_context_parallel=True)
               if dist.is_initialized() else 1)
    if dp_size > 1:
        values /= dp_size
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
    return {**dict(zip(names, values.tolist())), **expert_loads(chunks, config)}


def expert_loads(chunks: list, config: Any) -> dict[str, float]:
    """How the step's tokens spread over the experts, over every layer, stage and data-
    parallel rank (``moe.routing_figures``); every rank calls it."""
    counts = take_moe_step_routing(chunks, config.num_experts).to(
        parallel_state.get_default_device(), torch.float64)
    if dist.is_initialized():
        for group, size in (
                (parallel_state.get_pipeline_model_parallel_group(),
                 parallel_state.get_pipeline_model_parallel_world_size()),
                (parallel_state.get_data_parallel_group(with_context_parallel=True),
                 parallel_state.get_data_parallel_world_size(with_context_parallel=True))):
            if size > 1:
                dist.all_reduce(counts, group=group)
    return moe_routing_figures(counts[:-1].cpu(), float(counts[-1]),
                               config.moe_expert_capacity_factor is not None)


def empty_cuda_cache(ctx: RunContext, level: int) -> None:
    """--empty-unused-memory-level: hand the CUDA allocator's cached blocks back at ``level``."""
    if ctx.config.training.empty_unused_memory_level >= level and ctx.device.type == "cuda":
        torch.cuda.empty_cache()


class NativeEngine:
    """Our schedules, gradient reduction and optimizer, and Megatron's checkpoint files."""

    records_best = True

    def __init__(self, forward_step: Callable, chunks: list, optimizer: Any, scheduler: Any,
                 ctx: RunContext) -> None:
        self.forward_step, self.chunks, self.ctx = forward_step, chunks, ctx
        self.optimizer, self.scheduler = optimizer, scheduler

    def train_step(self, data_iterator, num_microbatches: int) -> StepResult:
        """Forward and backward over all micro-batches, gradient reduction, optimizer step.

        With --check-for-nan-in-loss-and-grad a step whose loss or grad norm is NaN/Inf on
        any rank is not applied (see megatron/core/nonfinite.py).
        """
        cfg, timers, optimizer = self.ctx.config, self.ctx.timers, self.optimizer
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.start_exchange()  # --dp-overlap: the neighbour average runs meanwhile
        timers("forward-backward", log_level=1).start()
        # The router losses' gradients are scaled as each micro-batch's loss is.
        set_moe_loss_scale(self.chunks, float(optimizer.scale_loss(1.0)) / num_microbatches)
        schedule = get_forward_backward_func()
        losses = schedule(forward_step_func=self._recording_forward_step,
                          data_iterator=data_iterator,
                          model=self.chunks, num_microbatches=num_microbatches,
                          seq_length=cfg.model.seq_length,
                          micro_batch_size=cfg.training.micro_batch_size,
                          grad_scale_func=optimizer.scale_loss, timers=timers)
        timers("forward-backward").stop()
        empty_cuda_cache(self.ctx, level=2)
        timers("grads-reduce", log_level=1).start()
        finalize_model_grads(self.chunks)
        update_expert_biases(self.chunks, cfg.model.moe_router_bias_update_rate,
                             sum_over_routing_ranks)
        timers("grads-reduce").stop()
        check = cfg.optimizer.check_for_nan_in_loss_and_grad
        bad_loss = locate_nonfinite_loss(losses) if check else None
        updated, grad_norm, num_zeros, nonfinite = False, None, None, None
        if bad_loss is not None:  # every rank: no step, and the exchange (if any) is dropped
            optimizer.cancel_exchange()
            nonfinite = describe_nonfinite_loss(*bad_loss, num_microbatches)
        else:
            timers("optimizer", log_level=1).start()
            updated, grad_norm, num_zeros = optimizer.step()
            timers("optimizer").stop()
            if check and not updated and grad_norm is not None:  # not an fp16 overflow
                nonfinite = describe_nonfinite_grad_norm(grad_norm, self.chunks)
        reported = {**reduce_losses(losses), **router_losses(self.chunks, cfg.model)}
        return StepResult(reported, not updated, grad_norm, num_zeros, nonfinite)

    @property
    def _recording_forward_step(self) -> Callable:
        """The forward step, then each router's losses of that micro-batch recorded (with
        the forward step's own signature: the schedule passes ``stage`` if it takes it)."""
        inner = self.forward_step
        if takes_stage(inner):
            def recording(data_iterator, model, stage):
                out = inner(data_iterator, model, stage=stage)
                record_moe_losses(model)
                return out
        else:
            def recording(data_iterator, model):
                out = inner(data_iterator, model)
                record_moe_losses(model)
                return out
        return recording

    def eval_losses(self, data_iterator, num_microbatches: int) -> list[dict]:
        cfg = self.ctx.config
        schedule = get_forward_backward_func()
        return schedule(forward_step_func=self.forward_step, data_iterator=data_iterator,
                        model=self.chunks, num_microbatches=num_microbatches,
                        seq_length=cfg.model.seq_length,
                        micro_batch_size=cfg.training.micro_batch_size, forward_only=True)

    def save(self, state: TrainState, valid_loss: Optional[float], saver: Any) -> str:
        """Megatron's checkpoint of ``state.iteration``; with ``saver`` (--async-save)
        written in the background from a host copy (which is checked for NaN/Inf there)."""
        self.optimizer.average_replicas()  # --dp-mode decentralized saves the replicas' mean
        if saver is None:  # a background save checks its host copy, off the loop
            check_finite_for_save(self.chunks, self.optimizer, state.iteration)
        return checkpointing.save_checkpoint(
            state.iteration, self.chunks, self.optimizer, self.scheduler, self.ctx.config,
            consumed_train_samples=state.consumed_train_samples,
            consumed_valid_samples=state.consumed_valid_samples, valid_loss=valid_loss,
            saver=saver, refuse_nonfinite=saver is not None)

    def load(self, state: TrainState, cfg: RunConfig) -> None:
        """Restore the latest checkpoint into the model, optimizer, scheduler and ``state``;
        say on one line (rank 0) what was loaded and what starts anew."""
        universal = find_universal(cfg.checkpoint.load, cfg.checkpoint.universal_checkpoint)
        if universal is not None:  # DeepSpeed's, read whole and cut for this layout
            loaded = load_universal_checkpoint(universal, self.chunks, self.optimizer,
                                               self.scheduler, cfg)
        else:
            loaded = checkpointing.load_checkpoint(self.chunks, self.optimizer, self.scheduler,
                                                   cfg)
        state.iteration, state.consumed_train_samples, state.consumed_valid_samples = loaded
        if loaded.report is None:
            return  # no checkpoint there (checkpointing warned)
        print_rank_0(format_load_report(loaded.report, cfg.checkpoint,
                                        state.consumed_train_samples,
                                        evaluating=cfg.training.eval_only))
        if state.iteration > 0 and not cfg.checkpoint.finetune:
            state.last_saved = state.iteration  # nothing new to save before a step
            state.last_checkpoint = loaded.report.folder


class XlaEngine(NativeEngine):
    """``NativeEngine`` on an XLA device: each iteration one traced graph (xla_step); under
    SPMD each device's rows of a micro-batch are a data-parallel rank's, and the loss is the
    mean of the devices' own losses (``xla_step.split_over_devices``)."""

    def __init__(self, forward_step: Callable, chunks: list, optimizer: Any, scheduler: Any,
                 ctx: RunContext) -> None:
        devices = ctx.config.parallel.devices_per_process
        super().__init__(xla_step.split_over_devices(forward_step, devices), chunks,
                         optimizer, scheduler, ctx)

    def train_step(self, data_iterator, num_microbatches: int) -> StepResult:
        step = xla_step.train_step(self.forward_step, data_iterator, self.chunks,
                                   self.optimizer, self.ctx.config, num_microbatches,
                                   self.ctx.timers)
        return StepResult(step.losses, not step.updated, step.grad_norm, None, step.nonfinite)


class DeepSpeedEngine:
    """DeepSpeed's engine (``DeepSpeedRun``): its step, its schedule of micro-batches and its
    checkpoint files; our loop, log, evaluation and exits."""

    records_best = False

    def __init__(self, run: Any, forward_step: Callable, ctx: RunContext) -> None:
        self.run, self.forward_step, self.ctx = run, forward_step, ctx
        self.chunks, self.optimizer, self.scheduler = run.chunks, run.optimizer, run.scheduler

    def train_step(self, data_iterator, num_microbatches: int) -> StepResult:
        """One iteration through DeepSpeed's engine, reported as ours reports it."""
        timers = self.ctx.timers
        timers("forward-backward-optimizer", log_level=1).start()
        losses, applied, grad_norm, bad_loss = self.run.train_step(
            self.forward_step, data_iterator, num_microbatches)
        timers("forward-backward-optimizer").stop()
        opt = self.ctx.config.optimizer
        nonfinite = None
        if bad_loss is not None:  # not applied (see DeepSpeedRun.train_step)
            nonfinite = describe_nonfinite_loss(*bad_loss, num_microbatches)
        elif opt.check_for_nan_in_loss_and_grad and not applied and not opt.fp16:
            # Not an fp16 overflow (the loss scaler's business, as in the built-in engine).
            nonfinite = (f"the grad norm ({grad_norm}; every micro-batch loss was finite; "
                         "DeepSpeed found NaN/Inf gradients)")
        return StepResult(reduce_losses(losses), not applied, grad_norm, None, nonfinite)

    def eval_losses(self, data_iterator, num_microbatches: int) -> list[dict]:
        return self.run.eval_step(self.forward_step, data_iterator, num_microbatches)

    def save(self, state: TrainState, valid_loss: Optional[float], saver: Any) -> str:
        return self.run.save(self.ctx.config.checkpoint.save, state.iteration,
                             state.consumed_train_samples, state.consumed_valid_samples)

    def load(self, state: TrainState, cfg: RunConfig) -> None:
        self.run.load(state)


def evaluate(engine: StepEngine, data_iterator, num_microbatches: int,
             eval_iters: int) -> dict[str, float]:
    """Mean loss over ``eval_iters`` forward-only iterations of ``engine``."""
    for chunk in engine.chunks:
        chunk.eval()
    totals: dict[str, float] = {}
    for _ in range(eval_iters):
        for name, value in reduce_losses(engine.eval_losses(data_iterator,
                                                            num_microbatches)).items():
            totals[name] = totals.get(name, 0.0) + value
    for chunk in engine.chunks:
        chunk.train()
    return {name: value / max(eval_iters, 1) for name, value in totals.items()}


def train_step(forward_step: Callable, data_iterator, chunks, optimizer, scheduler,
               ctx: RunContext, num_microbatches: int) -> StepResult:
    """One iteration of our engine for ``chunks`` (what benchmarks and tests time), the
    schedule advanced as the loop advances it."""
    engine = build_engine(ctx, forward_step, chunks, optimizer, scheduler)
    result = engine.train_step(data_iterator, num_microbatches)
    advance_schedule(scheduler, result, num_microbatches, ctx.config)
    return result


def advance_schedule(scheduler: Any, result: StepResult, num_microbatches: int,
                     cfg: RunConfig) -> None:
    """The learning-rate schedule moves by the samples of an applied step (a skipped one,
    fp16 overflow or NaN/Inf, moves nothing), for every engine."""
    if scheduler is not None and not result.skipped:
        scheduler.step(increment=num_microbatches * cfg.training.micro_batch_size
                       * data_parallel_size(cfg))

"""pretrain(): the training loop with evaluation, logging, checkpoints and clean exits.

Users supply three callbacks, as in Megatron (with the run context passed explicitly instead of
a global ``args``)::

    model_provider(ctx, pre_process, post_process, first_layer, num_layers) -> nn.Module
    train_valid_test_datasets_provider(ctx, [n_train, n_valid, n_test]) -> (train, valid, test)
    forward_step(ctx, data_iterator, model, stage) -> (output_tensor, loss_func)

``loss_func(output_tensor) -> (loss, {"lm loss": loss.detach()})``; reported values are
averaged over micro-batches and data-parallel ranks here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import math
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron import launcher_watch, training_xla, watchdog, xla
from megatron.assembly.build import (
    RunContext,
    build_run_tokenizer,
    check_dp_topology_or_exit,
    num_parameters,
    run_vocab_size,
    setup_model_and_optimizer,
)
from megatron.checkpointing.async_save import AsyncSaver
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.load import checkpoint_model_settings
from megatron.checkpointing.ranks import all_true, any_true, first_failure
from megatron.config import (
    ConfigError,
    RunConfig,
    parse_args,
    parse_args_or_exit,
    print_config,
)
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import bubble
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.data.dataset_utils import train_valid_test_num_samples as data_sample_counts
from megatron.initialize import initialize_megatron
from megatron.integrations.deepspeed import deepspeed_config_or_exit
from megatron.microbatches import NumMicroBatchesCalculator
from megatron.model.layer_norm import apex_layer_norm_used
from megatron.model.transformer import flash_attn_installed
from megatron.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    OverflowGuard,
    check_finite_for_save,
    describe_nonfinite_grad_norm,
    describe_nonfinite_loss,
    locate_nonfinite_loss,
)
from megatron.optimizer_param_scheduler import (
    ScheduleMismatchError,
    check_resumed_schedule_or_exit,
)
from megatron.signals import INTERRUPTED_EXIT_STATUS, TERMINATED_EXIT_STATUS, ShutdownSignals
from megatron.timers import Timers, format_across_ranks, gather_across_ranks
from megatron.training_log import (
    TensorBoard,
    WandbOffline,
    evaluation_series,
    flops_per_token,
    format_eval,
    format_load_report,
    format_log_line,
    format_memory_report,
    format_run_summary,
    memory_gb,
    training_series,
)
from megatron.utils import configure_output, global_rank, print_rank_0, refuse

# Iterations TrainState.history keeps: every one of the short runs tests and benchmarks make.
HISTORY_WINDOW = 1000


@dataclasses.dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    best_valid_loss: float = math.inf
    last_saved: Optional[int] = None
    # Per iteration of this process: {"iteration", "losses", "grad_norm", "skipped",
    # "nonfinite", "loss_scale", "params_norm"}; what tests and benchmarks read instead of
    # parsing the log. Only the last HISTORY_WINDOW iterations: the loop itself reads only the
    # newest, and a run of a million steps must not hold a million entries.
    history: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_WINDOW))
    last_checkpoint: Optional[str] = None  # folder of the last checkpoint saved or resumed
    last_valid_losses: dict = dataclasses.field(default_factory=dict)


# Run sizes -------------------------------------------------------------------------------


def data_parallel_size(cfg: RunConfig) -> int:
    """The run's data-parallel ranks: this process's data-parallel group's, times the XLA
    devices each process splits its micro-batches over (SPMD; else one)."""
    return parallel_state.get_data_parallel_world_size() * cfg.parallel.devices_per_process


def run_devices(cfg: RunConfig) -> int:
    """The devices of the run (what tokens and FLOP/s per GPU divide by): its processes,
    times the XLA devices of each under SPMD."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world * cfg.parallel.devices_per_process


# Data ------------------------------------------------------------------------------------


def train_valid_test_num_samples(cfg: RunConfig) -> list[int]:
    """[train, valid, test] samples the datasets must hold (the data layer's one formula)."""
    t = cfg.training
    return data_sample_counts(t.global_batch_size, t.eval_iters, t.eval_interval,
                              train_iters=t.train_iters, train_samples=t.train_samples)


def build_data_iterators(provider: Callable, ctx: RunContext, state: TrainState):
    """Iterators over this data-parallel rank's micro-batches for train, valid and test.

    Only the first and last pipeline stages read data (tokens and labels); others get None.
    """
    from megatron.data.samplers import build_pretraining_data_loader, shutdown_signals_blocked

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


# One iteration ---------------------------------------------------------------------------


def _reduce_losses(losses: list[dict[str, torch.Tensor]]) -> dict[str, float]:
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
    dp_size = parallel_state.get_data_parallel_world_size() if dist.is_initialized() else 1
    if dp_size > 1:
        values /= dp_size
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    if device.type == "xla":  # run the traced evaluation step before reading it
        xla.mark_step()
    return dict(zip(names, values.tolist()))


def _build_datasets_or_exit(provider: Optional[Callable], ctx: RunContext):
    """The provider's datasets (None: this rank builds none). A data error met while they
    are built (a full --data-cache-path) ends every rank with one ``error:`` line, as the
    start-up checks do; collective over all ranks."""
    from megatron.data.dataset_utils import DataConfigError

    datasets, error = None, None
    if provider is not None:
        try:
            datasets = provider(ctx, train_valid_test_num_samples(ctx.config))
        except DataConfigError as e:
            error = e
    if not all_true(error is None):
        refuse(first_failure(error)[1])
    return datasets


def empty_cuda_cache(ctx: RunContext, level: int) -> None:
    """--empty-unused-memory-level: hand the CUDA allocator's cached blocks back at ``level``."""
    if ctx.config.training.empty_unused_memory_level >= level and ctx.device.type == "cuda":
        torch.cuda.empty_cache()


class StepResult(NamedTuple):
    losses: dict[str, float]  # reduced over micro-batches and data-parallel ranks
    skipped: bool  # no update applied (fp16 overflow or a non-finite step)
    grad_norm: Optional[float]
    num_zeros: Optional[int]
    nonfinite: Optional[str]  # what was NaN/Inf when the guard skipped the step, else None


def train_step(forward_step: Callable, data_iterator, chunks, optimizer, scheduler,
               ctx: RunContext, num_microbatches: int) -> StepResult:
    """Forward and backward over all micro-batches, gradient reduction, optimizer step.

    With --check-for-nan-in-loss-and-grad a step whose loss or grad norm is NaN/Inf on any
    rank is not applied (see megatron/nonfinite.py); like any skipped step it does not
    advance the learning-rate schedule.
    """
    cfg, timers = ctx.config, ctx.timers
    if ctx.device.type == "xla":
        return _xla_train_step(forward_step, data_iterator, chunks, optimizer, scheduler, ctx,
                               num_microbatches)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.start_exchange()  # --dp-overlap: the neighbour average runs meanwhile
    timers("forward-backward", log_level=1).start()
    schedule = get_forward_backward_func()
    losses = schedule(forward_step_func=forward_step, data_iterator=data_iterator,
                      model=chunks, num_microbatches=num_microbatches,
                      seq_length=cfg.model.seq_length,
                      micro_batch_size=cfg.training.micro_batch_size,
                      grad_scale_func=optimizer.scale_loss, timers=timers)
    timers("forward-backward").stop()
    empty_cuda_cache(ctx, level=2)
    timers("grads-reduce", log_level=1).start()
    finalize_model_grads(chunks)
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
            nonfinite = describe_nonfinite_grad_norm(grad_norm, chunks)
    if updated:
        scheduler.step(increment=num_microbatches * cfg.training.micro_batch_size
                       * data_parallel_size(cfg))
    return StepResult(_reduce_losses(losses), not updated, grad_norm, num_zeros, nonfinite)


def _xla_train_step(forward_step: Callable, data_iterator, chunks, optimizer, scheduler,
                    ctx: RunContext, num_microbatches: int) -> StepResult:
    """``train_step`` on an XLA device: one traced graph per iteration (training_xla)."""
    cfg = ctx.config
    step = training_xla.train_step(forward_step, data_iterator, chunks, optimizer, cfg,
                                   num_microbatches, ctx.timers)
    if step.updated:
        scheduler.step(increment=num_microbatches * cfg.training.micro_batch_size
                       * data_parallel_size(cfg))
    return StepResult(step.losses, not step.updated, step.grad_norm, None, step.nonfinite)


def engine_train_step(engine, forward_step: Callable, data_iterator, ctx: RunContext,
                      num_microbatches: int) -> StepResult:
    """One iteration through DeepSpeed's engine, reported as ``train_step`` reports it."""
    timers = ctx.timers
    timers("forward-backward-optimizer", log_level=1).start()
    losses, applied, grad_norm, bad_loss = engine.train_step(forward_step, data_iterator,
                                                             num_microbatches)
    timers("forward-backward-optimizer").stop()
    opt = ctx.config.optimizer
    nonfinite = None
    if bad_loss is not None:  # not applied (see DeepSpeedRun.train_step)
        nonfinite = describe_nonfinite_loss(*bad_loss, num_microbatches)
    elif opt.check_for_nan_in_loss_and_grad and not applied and not opt.fp16:
        # Not an fp16 overflow (the loss scaler's business, as in the built-in engine).
        nonfinite = (f"the grad norm ({grad_norm}; every micro-batch loss was finite; DeepSpeed "
                     "found NaN/Inf gradients)")
    return StepResult(_reduce_losses(losses), not applied, grad_norm, None, nonfinite)


def evaluate(forward_step: Callable, data_iterator, chunks, ctx: RunContext,
             num_microbatches: int, eval_iters: int, engine=None) -> dict[str, float]:
    """Mean loss over ``eval_iters`` forward-only iterations (through DeepSpeed's ``engine``
    where it trains)."""
    for chunk in chunks:
        chunk.eval()
    totals: dict[str, float] = {}
    schedule = get_forward_backward_func()
    for _ in range(eval_iters):
        if engine is not None:
            losses = engine.eval_step(forward_step, data_iterator, num_microbatches)
        else:
            losses = schedule(forward_step_func=forward_step, data_iterator=data_iterator,
                              model=chunks, num_microbatches=num_microbatches,
                              seq_length=ctx.config.model.seq_length,
                              micro_batch_size=ctx.config.training.micro_batch_size,
                              forward_only=True)
        for name, value in _reduce_losses(losses).items():
            totals[name] = totals.get(name, 0.0) + value
    for chunk in chunks:
        chunk.train()
    return {name: value / max(eval_iters, 1) for name, value in totals.items()}


# Exits -----------------------------------------------------------------------------------


# The loop --------------------------------------------------------------------------------


class Trainer:
    """Holds what the loop needs between iterations; ``train()`` runs to the end or an exit."""

    def __init__(self, ctx: RunContext, forward_step, chunks, optimizer, scheduler,
                 iterators, state: TrainState, signals: ShutdownSignals,
                 engine=None) -> None:
        self.ctx, self.cfg = ctx, ctx.config
        # DeepSpeed's engine (megatron/integrations/deepspeed.py DeepSpeedRun) where it
        # trains: it replaces the schedule, the step and the checkpoint files, nothing else.
        self.engine = engine
        self.forward_step, self.chunks = forward_step, chunks
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_iter, self.valid_iter, self.test_iter = iterators
        # Middle pipeline stages read no data but must join every evaluation.
        self.has_valid = any_true(self.valid_iter is not None)
        self.has_test = any_true(self.test_iter is not None)
        self.state = state
        t = self.cfg.training
        self.calculator = NumMicroBatchesCalculator(
            t.global_batch_size, t.micro_batch_size, data_parallel_size(self.cfg),
            t.rampup_batch_size)
        is_logger = not dist.is_initialized() or dist.get_rank() == 0
        wandb = WandbOffline(self.cfg.logging, self.cfg.checkpoint.save, self.cfg.to_dict(),
                             is_logger)
        self.tensorboard = TensorBoard(self.cfg.logging.tensorboard_dir, is_logger,
                                       self.cfg.logging.tensorboard_queue_size, wandb)
        self.signals = signals
        # --async-save: checkpoints written in the background (built on every rank: a group).
        self.saver = AsyncSaver(t.distributed_timeout_minutes) \
            if self.cfg.checkpoint.async_save else None
        self._host_buffers_reserved = False
        self.guard = NonFiniteGuard(t.max_consecutive_nonfinite_iterations)
        opt = self.cfg.optimizer
        self.overflow_guard = (OverflowGuard(t.max_consecutive_nonfinite_iterations,
                                             opt.loss_scale, opt.min_loss_scale)
                               if opt.fp16 else None)
        self._refused_save: Optional[int] = None
        self.save_lock = None  # rank 0's lock of --save (start_run), released at the end
        self.start_time = time.time()
        self._interval: dict[str, float] = {}
        self._interval_iters = self._skipped = self._nan = 0
        self._interval_tokens = 0
        self._interval_start = self._last_iteration_end = time.perf_counter()
        self._memory_reported = False

    @functools.cached_property
    def train_iters(self) -> int:
        """The run's length in iterations (fixed by the config; under --train-samples with a
        batch-size ramp-up counting it walks the whole ramp, so it is computed once)."""
        t = self.cfg.training
        if t.train_iters is not None:
            return t.train_iters
        return self._iters_for_samples(t.train_samples)

    def _iters_for_samples(self, samples: int) -> int:
        """Iterations needed to consume ``samples`` under the batch-size ramp-up."""
        calc = NumMicroBatchesCalculator(
            self.calculator.global_batch_size, self.cfg.training.micro_batch_size,
            data_parallel_size(self.cfg), self.cfg.training.rampup_batch_size)
        consumed = iterations = 0
        while consumed < samples:
            calc.update(consumed)
            consumed += calc.current_global_batch_size
            iterations += 1
        return iterations

    def train(self) -> str:
        """Run until train_iters; returns why it stopped ("done", "signal", ...)."""
        t = self.cfg.training
        if not t.manual_gc:
            return self._train()
        gc.disable()  # collections at random points stall every rank in turn
        gc.collect()
        try:
            return self._train()
        finally:
            gc.enable()

    def _collect_garbage(self, at_evaluation: bool = False) -> None:
        t = self.cfg.training
        if t.manual_gc and (t.manual_gc_eval or not at_evaluation):
            gc.collect()

    def _train(self) -> str:
        s, t = self.state, self.cfg.training
        for chunk in self.chunks:
            chunk.train()
        seq = self.cfg.model.seq_length
        while s.iteration < self.train_iters and (
                t.train_tokens is None or s.consumed_train_samples * seq < t.train_tokens):
            self.ctx.progress.step(s.iteration + 1)
            self.calculator.update(s.consumed_train_samples)
            num_micro = self.calculator.num_microbatches
            gbs = self.calculator.current_global_batch_size
            scale = self._fp16_loss_scale()  # the scale this step begins with
            if self.engine is not None:
                result = engine_train_step(self.engine, self.forward_step, self.train_iter,
                                           self.ctx, num_micro)
            else:
                result = train_step(self.forward_step, self.train_iter, self.chunks,
                                    self.optimizer, self.scheduler, self.ctx, num_micro)
            s.iteration += 1
            s.consumed_train_samples += gbs
            empty_cuda_cache(self.ctx, level=1)
            if t.manual_gc and t.manual_gc_interval and s.iteration % t.manual_gc_interval == 0:
                self._collect_garbage()
            self._warn_nonfinite(result.nonfinite)
            self._warn_overflow(result, scale)
            self._account(result, gbs)
            if self.guard.must_stop:
                raise self.guard.stop_error(s.iteration, self.cfg.checkpoint.save,
                                            s.last_saved)
            if self.overflow_guard is not None and self.overflow_guard.must_stop:
                raise self.overflow_guard.stop_error(s.iteration)
            reason = self._after_iteration()
            if reason:
                return reason
        return "done"

    def _account(self, result: StepResult, gbs: int) -> None:
        s, losses = self.state, result.losses
        scale = self.optimizer.get_loss_scale()
        s.history.append(dict(iteration=s.iteration, losses=losses, grad_norm=result.grad_norm,
                              skipped=result.skipped, nonfinite=result.nonfinite is not None,
                              loss_scale=float(scale) if scale is not None else None))
        if self.ctx.device.type == "xla":
            training_xla.record_compilations(s.history[-1])
        self._interval_iters += 1
        self._interval_tokens += gbs * self.cfg.model.seq_length
        self._skipped += int(result.skipped)
        bad = result.nonfinite is not None or any(not math.isfinite(v) for v in losses.values())
        self._nan += int(bad)
        if not result.skipped and not bad:
            for name, value in losses.items():
                self._interval[name] = self._interval.get(name, 0.0) + value
        log = self.cfg.logging
        to_log = s.iteration % log.log_interval == 0
        to_tensorboard = s.iteration % log.tensorboard_log_interval == 0
        # --log-params-norm: a collective over the model-parallel ranks, which all log alike.
        params_norm = (self.optimizer.params_norm()
                       if log.log_params_norm and (to_log or to_tensorboard) else None)
        s.history[-1]["params_norm"] = params_norm
        now = time.perf_counter()
        if to_tensorboard:
            self._write_tensorboard(losses, gbs, result.grad_norm, result.num_zeros,
                                    params_norm, now - self._last_iteration_end)
        self._last_iteration_end = now
        if to_log:
            self._log(gbs, result.grad_norm, result.num_zeros, params_norm)

    def _warn_nonfinite(self, nonfinite: Optional[str]) -> None:
        warning = self.guard.observe(self.state.iteration, nonfinite)
        if warning:
            print_rank_0(warning)

    def _fp16_loss_scale(self) -> Optional[float]:
        if self.overflow_guard is None:
            return None
        scale = self.optimizer.get_loss_scale()
        return float(scale) if scale is not None else None

    def _warn_overflow(self, result: StepResult, scale: Optional[float]) -> None:
        """fp16: a step the loss scaler skipped (not one the NaN guard skipped)."""
        if self.overflow_guard is None:
            return
        overflowed = result.skipped and result.nonfinite is None
        warning = self.overflow_guard.observe(self.state.iteration, overflowed, scale)
        if warning:
            print_rank_0(warning)

    def _current_readings(self) -> tuple[float, Optional[float], int]:
        """The learning rate, the loss scale (fp16 only, else None) and the world size now
        (in devices: what per-GPU rates divide by)."""
        scale = self.optimizer.get_loss_scale()
        scale = float(scale) if (self.cfg.optimizer.fp16 and scale is not None) else None
        return self.optimizer.param_groups[0]["lr"], scale, run_devices(self.cfg)

    def _write_tensorboard(self, losses, gbs, grad_norm, num_zeros, params_norm,
                           iteration_seconds: float) -> None:
        """This iteration's values, every --tensorboard-log-interval iterations (as
        Megatron-DeepSpeed writes them), against iterations, samples and tokens."""
        cfg = self.cfg
        lr, scale, world = self._current_readings()
        scalars = dict(losses)
        if cfg.logging.log_loss_scale_to_tensorboard:
            scalars["loss-scale"] = scale
        if cfg.logging.log_world_size_to_tensorboard:
            scalars["world-size"] = world
        scalars.update({"learning-rate": lr, "grad-norm": grad_norm, "batch-size": gbs,
                        "params-norm": params_norm})
        self.tensorboard.scalars(scalars, self.state.iteration)
        axes = self._tensorboard_axes()
        series = training_series(
            losses, learning_rate=lr, batch_size=gbs, loss_scale=scale, grad_norm=grad_norm,
            num_zeros=num_zeros, world_size=world, iteration_seconds=iteration_seconds,
            logging=cfg.logging)
        if params_norm is not None:
            series["params-norm/params-norm"] = params_norm
        self.tensorboard.series(series, **axes)
        self.tensorboard.axes(**axes)

    def _log(self, gbs: int, grad_norm, num_zeros, params_norm) -> None:
        s, cfg = self.state, self.cfg
        elapsed = time.perf_counter() - self._interval_start
        iters = max(self._interval_iters, 1)
        good = max(self._interval_iters - self._skipped - self._nan, 1)
        losses = {name: total / good for name, total in self._interval.items()}
        lr, scale, world = self._current_readings()
        tgs = self._interval_tokens / max(elapsed, 1e-9) / world
        tflops = tgs * flops_per_token(cfg.model) / 1e12
        print_rank_0(format_log_line(
            iteration=s.iteration, train_iters=self.train_iters,
            consumed_samples=s.consumed_train_samples, elapsed_ms=1000.0 * elapsed / iters,
            lr=lr, global_batch_size=gbs, losses=losses,
            loss_scale=scale if cfg.optimizer.fp16 else 1.0, grad_norm=grad_norm,
            skipped=self._skipped, nan=self._nan, tgs=tgs, tflops=tflops,
            num_zeros=num_zeros if cfg.optimizer.log_num_zeros_in_grad else None,
            params_norm=params_norm))
        self._report_memory_once()
        timings = self.ctx.timers.pop_all()
        if cfg.logging.timing_log_level > 0:  # the same on every rank: a collective is safe
            print_rank_0(format_across_ranks(gather_across_ranks(timings),
                                             cfg.logging.timing_log_option, iters))
        if cfg.logging.log_bubble and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            stages = bubble.gather_stage_times(bubble.StageTimes.from_timings(timings))
            print_rank_0(bubble.format_bubble(
                stages, self.calculator.num_microbatches,
                cfg.parallel.virtual_pipeline_model_parallel_size, iters))
        # Rates over the logging interval; the per-iteration values go out in _account.
        scalars = {"tokens-per-gpu-per-second": tgs, "tflops-per-gpu": tflops,
                   "mem-max-gb": memory_gb(), "iteration-time-ms": 1000.0 * elapsed / iters}
        if cfg.logging.log_timers_to_tensorboard:
            scalars.update({f"timers/{k}": 1000.0 * v / iters for k, v in timings.items()})
        self.tensorboard.scalars(scalars, s.iteration)
        self._interval, self._interval_iters, self._interval_tokens = {}, 0, 0
        self._skipped = self._nan = 0
        self._interval_start = time.perf_counter()

    def _tensorboard_axes(self) -> dict[str, int]:
        """Megatron-DeepSpeed's x axes: iteration, consumed samples, consumed tokens."""
        samples = self.state.consumed_train_samples
        return dict(iteration=self.state.iteration, samples=samples,
                    tokens=samples * self.cfg.model.seq_length)

    def _report_memory_once(self) -> None:
        """After the first logged iteration (the peak includes the optimizer state by then),
        as Megatron does: one line per model-parallel rank, from data-parallel rank 0."""
        if self._memory_reported or self.ctx.device.type != "cuda":
            return
        self._memory_reported = True
        if parallel_state.get_data_parallel_rank() == 0:
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(format_memory_report(rank, self.state.iteration), flush=True)

    def run_evaluation(self, prefix: str, data_iterator, eval_iters: int,
                       has_data: bool = True, tag: Optional[str] = None) -> dict[str, float]:
        if not has_data or eval_iters == 0:
            return {}
        num_micro = self.cfg.num_microbatches
        self.ctx.progress.mark(f"the evaluation \"{prefix}\"")
        self._collect_garbage(at_evaluation=True)
        losses = evaluate(self.forward_step, data_iterator, self.chunks, self.ctx, num_micro,
                          eval_iters, self.engine)
        self._collect_garbage(at_evaluation=True)
        empty_cuda_cache(self.ctx, level=1)
        print_rank_0(format_eval(prefix, losses))
        step = self.state.iteration
        tag = tag or ("validation" if "valid" in prefix else "test")
        for name, value in losses.items():
            self.tensorboard.scalars({f"{name} {tag}": value,
                                      f"{name} {tag} ppl": math.exp(min(20.0, value))}, step)
        self.tensorboard.series(evaluation_series(
            losses, tag, self.cfg.logging.log_validation_ppl_to_tensorboard),
            **self._tensorboard_axes())
        if tag == "validation":
            self.state.last_valid_losses = losses
        return losses

    def _after_iteration(self) -> Optional[str]:
        s, cfg = self.state, self.cfg
        it = s.iteration
        t, ck = cfg.training, cfg.checkpoint
        if self.saver is not None and self.saver.poll() is not None:
            self.signals.writing_in_background(False)
        if self.saver is not None and not self._host_buffers_reserved:
            # After this run's first step (the optimizer's state exists): the first save then
            # copies into memory mapped in the background, as later saves do.
            from megatron import checkpointing

            checkpointing.reserve_host_buffers(it, self.chunks, self.optimizer, self.scheduler,
                                               self.cfg, self.saver)
            self._host_buffers_reserved = True
        if t.eval_interval and it % t.eval_interval == 0 and self.has_valid:
            losses = self.run_evaluation(f"validation loss at iteration {it}", self.valid_iter,
                                         t.eval_iters)
            s.consumed_valid_samples += t.eval_iters * t.global_batch_size
            self._track_best(losses)
        if ck.save and ck.save_interval and it % ck.save_interval == 0:
            self.save()
        reason = None
        if any_true(self.signals.received is not None or self.signals.while_writing is not None):
            reason = "signal" if t.exit_signal_handler else "signal-while-writing"
        elif t.exit_duration_in_mins and any_true(
                (time.time() - self.start_time) / 60.0 > t.exit_duration_in_mins):
            reason = "duration"
        elif t.exit_interval and it % t.exit_interval == 0:
            reason = "interval"
        if reason and ck.save and reason != "signal-while-writing":
            self.save()  # once: a no-op if this iteration is saved already
        if reason:
            self.finish_writing()
        return reason

    def finish(self) -> None:
        """After the last iteration: validation (unless just done), save, test."""
        s, t = self.state, self.cfg.training
        if t.eval_iters and s.iteration % t.eval_interval != 0:
            losses = self.run_evaluation(
                f"validation loss at the end of training (iteration {s.iteration})",
                self.valid_iter, t.eval_iters, self.has_valid)
            self._track_best(losses)
        if self.cfg.checkpoint.save:
            self.save()
            self.finish_writing()
        self.run_evaluation(f"test loss at the end of training (iteration {s.iteration})",
                            self.test_iter, t.eval_iters, self.has_test)

    def evaluate_only(self) -> None:
        """--eval-only: the loaded model's validation and test loss, in Megatron-LM's lines
        for --skip-train; nothing is trained or saved."""
        s, t = self.state, self.cfg.training
        for name, iterator, has_data in (("validation", self.valid_iter, self.has_valid),
                                         ("test", self.test_iter, self.has_test)):
            self.run_evaluation(f"validation loss at iteration {s.iteration} on {name} set",
                                iterator, t.eval_iters, has_data, tag=name)

    def _track_best(self, losses: dict[str, float]) -> None:
        loss = losses.get("lm loss")
        ck = self.cfg.checkpoint
        if loss is None or not ck.save_best or not ck.save:
            return
        if loss < self.state.best_valid_loss:
            self.state.best_valid_loss = loss
            if self.state.last_saved != self.state.iteration and self.engine is None:
                self.save(valid_loss=loss)  # recorded as the best when it is published
                return
            self.finish_writing()  # this iteration's folder must exist to be named the best
            if self.save() and (not dist.is_initialized() or dist.get_rank() == 0):
                from megatron import checkpointing

                checkpointing.update_best_checkpoint(ck.save, self.state.iteration, loss)

    def finish_writing(self) -> None:
        """Wait for a checkpoint written in the background (--async-save) and publish it;
        collective. A failed write raises ``CheckpointError`` on every rank."""
        if self.saver is not None and self.saver.wait() is not None:
            self.signals.writing_in_background(False)

    def save(self, valid_loss: Optional[float] = None) -> bool:
        """Save this iteration once; returns whether it has a checkpoint now (or, with
        --async-save, is being written). None is saved at an iteration whose step was skipped
        as non-finite, and none that holds a NaN/Inf (``NonFiniteError`` on every rank
        instead). ``valid_loss``: recorded as the best checkpoint's (--save-best) if lowest."""
        s = self.state
        from megatron import checkpointing

        if s.last_saved == s.iteration:
            return True
        self.ctx.progress.mark(f"the checkpoint save at iteration {s.iteration}")
        if self.guard.in_nonfinite_run:
            if self._refused_save != s.iteration:
                self._refused_save = s.iteration
                print_rank_0(f"  not saving a checkpoint at iteration {s.iteration}: its step "
                             f"was NaN/Inf and skipped (latest checkpoint: {s.last_saved})")
            return False
        with self.signals.saving():  # Ctrl-C waits for the save to be complete
            if self.engine is not None:
                folder = self.engine.save(self.cfg.checkpoint.save, s.iteration,
                                          s.consumed_train_samples, s.consumed_valid_samples)
            else:
                # --dp-mode decentralized saves the replicas' mean.
                self.optimizer.average_replicas()
                if self.saver is None:  # a background save checks its host copy, off the
                    check_finite_for_save(self.chunks, self.optimizer, s.iteration)  # loop
                else:  # signals wait for the background write, from before its thread starts
                    self.signals.writing_in_background(True)
                folder = checkpointing.save_checkpoint(
                    s.iteration, self.chunks, self.optimizer, self.scheduler, self.cfg,
                    consumed_train_samples=s.consumed_train_samples,
                    consumed_valid_samples=s.consumed_valid_samples, valid_loss=valid_loss,
                    saver=self.saver, refuse_nonfinite=self.saver is not None)
            # checkpointing logs the save ("successfully saved checkpoint ..."); the run
            # summary names the last folder.
            s.last_saved, s.last_checkpoint = s.iteration, folder
        return True


# Entry -----------------------------------------------------------------------------------


def check_run_inputs(cfg: RunConfig):
    """The run's tokenizer, built and checked with the data files before any process group or
    model exists: bad input ends the run with ``error: ...`` naming the flag or file, and
    status 2. Returns the tokenizer (None for --mock-data without tokenizer files)."""
    from megatron.data.checks import check_training_data
    from megatron.data.dataset_utils import DataConfigError
    from megatron.data.indexed_dataset import IndexedDatasetError
    from megatron.tokenizer import TokenizerConfigError

    try:
        tokenizer = build_run_tokenizer(cfg)
        samples = train_valid_test_num_samples(cfg)
        check_training_data(cfg.data, tokenizer.vocab_size if tokenizer is not None else None,
                            samples[0], cfg.model.seq_length, (samples[1], samples[2]))
    except (TokenizerConfigError, DataConfigError, IndexedDatasetError) as error:
        refuse(str(error))
    return tokenizer


class RunCallbacks(NamedTuple):
    """The user's three callbacks (see the module docstring)."""

    datasets_provider: Callable
    model_provider: Callable
    forward_step: Callable


def pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable,
             forward_step_func: Callable, *, extra_args_provider: Optional[Callable] = None,
             args_defaults: Optional[dict] = None, argv: Optional[list[str]] = None) -> TrainState:
    """Parse flags, initialize, build, train, evaluate and save; returns the final state.
    With --rehearse, rehearse the launch on this machine instead (megatron/rehearsal).

    Ctrl-C (SIGINT) ends it with one line on rank 0 and ``SystemExit(130)``, or, with
    --exit-signal-handler, as SIGTERM does (see megatron/signals.py). A communication that
    times out (--distributed-timeout-minutes) ends the process with one line and status 1; a
    stall prints the stacks (--hang-timeout-minutes; megatron/watchdog.py)."""
    wall_start = time.perf_counter()
    launcher_watch.stop_with_launcher()  # first: a worker whose torchrun agent died ends
    cfg = parse_args_or_exit(argv, extra_args_provider, defaults=args_defaults,
                             checkpoint_settings=checkpoint_model_settings)
    callbacks = RunCallbacks(train_valid_test_datasets_provider, model_provider,
                             forward_step_func)
    if cfg.training.rehearse:
        from megatron.rehearsal.entry import rehearse_or_exit

        rehearse_or_exit(cfg, rank_starter(callbacks))
    configure_output(cfg.logging.log_all_ranks)
    _check_device_support_or_exit(cfg)
    if training_xla.launches_replicas(cfg):
        from megatron.initialize import free_port

        xla.launch_replicas(
            functools.partial(pretrain, train_valid_test_datasets_provider, model_provider,
                              forward_step_func, extra_args_provider=extra_args_provider,
                              args_defaults=args_defaults, argv=argv),
            cfg.training.xla_processes, cfg.training.mp_start_method, free_port())
        return TrainState()
    cfg = _with_xla_spmd_or_exit(cfg, argv, extra_args_provider, args_defaults)
    _check_device_support_or_exit(cfg, replica=True)
    signals = ShutdownSignals(cfg.training.exit_signal_handler)
    state = TrainState()
    progress = watchdog.Progress("start-up (joining the other ranks)")
    try:
        with watchdog.exit_on_communication_timeout(progress):
            return _pretrain(cfg, state, signals, progress, wall_start, callbacks)
    except BaseException as error:
        # An interrupted peer leaves its collectives: the errors that follow are the interrupt.
        if not signals.was_interrupted() or (isinstance(error, SystemExit) and error.code == 0):
            raise
        if global_rank() == 0:
            print(_interrupted_message(state, cfg), file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_EXIT_STATUS) from None
    finally:
        progress.close()
        signals.restore()


def _pretrain(cfg: RunConfig, state: TrainState, signals: ShutdownSignals,
              progress: watchdog.Progress, wall_start: float,
              callbacks: RunCallbacks) -> TrainState:
    """pretrain() after the flags are parsed; fills ``state`` as it goes."""
    _check_checkpoint_folders_or_exit(cfg)
    check_dp_topology_or_exit(cfg)
    tokenizer = check_run_inputs(cfg)
    ds_config = deepspeed_config_or_exit(cfg)
    check_resumed_schedule_or_exit(cfg, ds_config)
    if cfg.training.dry_run:
        return _dry_run(cfg.with_vocab_size(run_vocab_size(cfg, tokenizer)))
    trainer = start_run(cfg, tokenizer, ds_config, callbacks, state, signals, progress)
    if cfg.training.eval_only:
        trainer.evaluate_only()
        trainer.tensorboard.close()
        _finish()
        return state
    print_rank_0(f"training from iteration {state.iteration} to {trainer.train_iters} ...")
    start = _RunStart(wall_start, state.iteration, state.consumed_train_samples)
    loop_start = time.perf_counter()
    try:
        reason = trainer.train()
        loop_seconds = time.perf_counter() - loop_start
        if reason == "done":
            trainer.finish()
        else:
            signals.stopping = reason == "signal"
            if reason == "signal-while-writing" and any_true(signals.while_writing == "SIGINT"):
                signals.interrupt()  # Ctrl-C, now that the checkpoint being written is complete
            print_rank_0(_exit_message(reason, state, trainer.cfg,
                                       signals.received or signals.while_writing))
        if reason == "signal-while-writing":  # SIGTERM's own status, once the save is done
            _end_run(trainer, start, loop_seconds)
            raise SystemExit(TERMINATED_EXIT_STATUS)
    except NonFiniteError as error:
        # Every rank raised it at the same point (its decisions are collective).
        trainer.finish_writing()  # a checkpoint of a finite iteration being written
        trainer.tensorboard.close()
        _finish()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    _end_run(trainer, start, loop_seconds)
    if trainer.save_lock is not None:
        trainer.save_lock.release()
    return state


def rank_starter(callbacks: RunCallbacks) -> Callable[[RunConfig, Any, ShutdownSignals], Trainer]:
    """Each rehearsed rank's set-up (megatron/rehearsal): ``start_run`` with the run's
    providers, a fresh state and no DeepSpeed config."""
    def start(cfg: RunConfig, tokenizer: Any, signals: ShutdownSignals) -> Trainer:
        return start_run(cfg, tokenizer, None, callbacks, TrainState(), signals)

    return start


def start_run(cfg: RunConfig, tokenizer, ds_config: Optional[dict], callbacks: RunCallbacks,
              state: TrainState, signals: ShutdownSignals,
              progress: Optional[watchdog.Progress] = None) -> Trainer:
    """This rank's set-up, up to the first iteration: process groups, the --save lock, model
    chunks, optimizer (or DeepSpeed's engine), checkpoint, data iterators; returns the
    ``Trainer`` that runs the loop and fills ``state``. ``cfg`` is the parsed config (before
    the vocabulary is known); ``progress``: what the hang watchdog follows (none watched
    without it). The rehearsal runs each rank's set-up through here too."""
    device = initialize_megatron(cfg)
    save_lock = _lock_save_folder_or_exit(cfg)
    if progress is None:
        progress = watchdog.Progress()
    else:
        progress.mark("start-up (model, checkpoint, data)")
        progress.watch(cfg.training.hang_timeout_minutes)
    cfg = cfg.with_vocab_size(run_vocab_size(cfg, tokenizer))
    # The arguments block shows what this device uses, not what was asked for.
    cfg = cfg.replace(model=cfg.model.replace(
        apex_layernorm=apex_layer_norm_used(cfg.model, device)))
    # --log-bubble needs the schedule's phase timers (level 1) whatever is printed.
    timer_level = max(cfg.logging.timing_log_level, 1 if cfg.logging.log_bubble else 0)
    spmd = cfg.parallel.xla_spmd_devices
    ctx = RunContext(cfg, tokenizer, Timers(timer_level), device, progress=progress,
                     spmd_mesh=xla.build_data_mesh(spmd) if spmd is not None else None)
    print_config(cfg, print_fn=print_rank_0)
    _warn_slow_precision(cfg, ctx.device)
    if cfg.model.use_flash_attn and not flash_attn_installed():
        print_rank_0("> --use-flash-attn: the flash_attn package is not installed; attention "
                     "runs through PyTorch's scaled_dot_product_attention (its flash kernel on "
                     "a GPU in bf16/fp16)")

    engine = None
    if ds_config is not None:
        from megatron.integrations import deepspeed as ds_integration

        engine = ds_integration.setup_engine(callbacks.model_provider, ctx, ds_config)
        chunks, optimizer, scheduler = engine.chunks, engine.optimizer, engine.scheduler
    else:
        chunks, optimizer, scheduler = setup_model_and_optimizer(callbacks.model_provider, ctx)
    print_rank_0(f" > number of parameters on (tensor, pipeline) model parallel rank "
                 f"({parallel_state.get_tensor_model_parallel_rank()}, "
                 f"{parallel_state.get_pipeline_model_parallel_rank()}): {num_parameters(chunks)}")
    try:
        if cfg.checkpoint.load and engine is not None:
            engine.load(state)
        elif cfg.checkpoint.load:
            load_into(state, chunks, optimizer, scheduler, _eval_only_load(cfg))
    except ScheduleMismatchError as error:  # one the start-up check could not read ahead
        refuse(f"--load {cfg.checkpoint.load}: {error}")  # every rank has the same state
    forward_step = functools.partial(callbacks.forward_step, ctx)
    iterators = build_data_iterators(callbacks.datasets_provider, ctx, state)
    trainer = Trainer(ctx, forward_step, chunks, optimizer, scheduler, iterators, state,
                      signals, engine)
    trainer.save_lock = save_lock
    return trainer


def _dry_run(cfg: RunConfig) -> TrainState:
    """--dry-run: print the run's plan (megatron/planner.py, as tools/plan.py does), judged
    against this machine's GPU memory where there is a GPU, and train nothing."""
    from megatron.planner import build_plan, format_plan

    gpu_gb = None
    if torch.cuda.is_available() and not cfg.training.use_cpu:
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    print_rank_0(format_plan(build_plan(cfg, cfg.deepspeed.zero_stage or 0, gpu_gb)))
    return TrainState()


def load_into(state: TrainState, chunks, optimizer, scheduler, cfg: RunConfig) -> None:
    """--load: restore the latest checkpoint into the model, optimizer, scheduler and
    ``state``; say on one line (rank 0) what was loaded and what starts anew."""
    from megatron import checkpointing
    from megatron.checkpointing.universal import find_universal

    universal = find_universal(cfg.checkpoint.load, cfg.checkpoint.universal_checkpoint)
    if universal is not None:  # DeepSpeed's, read whole and cut for this layout
        from megatron.conversion.universal import load_universal_checkpoint

        loaded = load_universal_checkpoint(universal, chunks, optimizer, scheduler, cfg)
    else:
        loaded = checkpointing.load_checkpoint(chunks, optimizer, scheduler, cfg)
    state.iteration, state.consumed_train_samples, state.consumed_valid_samples = loaded
    if loaded.report is None:
        return  # no checkpoint there (checkpointing warned)
    print_rank_0(format_load_report(loaded.report, cfg.checkpoint,
                                    state.consumed_train_samples,
                                    evaluating=cfg.training.eval_only))
    if state.iteration > 0 and not cfg.checkpoint.finetune:
        state.last_saved = state.iteration  # nothing new to save before a step
        state.last_checkpoint = loaded.report.folder


def _eval_only_load(cfg: RunConfig) -> RunConfig:
    """Under --eval-only a --load without a checkpoint is an error, not a fresh start, and
    only the model is read: an evaluation needs no optimizer, schedule or generator state,
    so a model-only checkpoint (--no-save-optim, the converter's output) loads as it is."""
    if not cfg.training.eval_only:
        return cfg
    return cfg.replace(checkpoint=dataclasses.replace(
        cfg.checkpoint, exit_on_missing_checkpoint=True, no_load_optim=True, no_load_rng=True))


class _RunStart(NamedTuple):
    wall_time: float  # time.perf_counter() when pretrain() began
    iteration: int
    consumed_train_samples: int


def _end_run(trainer: Trainer, start: _RunStart, loop_seconds: float) -> None:
    """The run's one-line summary (rank 0), then TensorBoard closed and every rank joined."""
    s, cfg = trainer.state, trainer.cfg
    print_rank_0(format_run_summary(
        iterations=s.iteration - start.iteration,
        tokens=(s.consumed_train_samples - start.consumed_train_samples) * cfg.model.seq_length,
        wall_seconds=time.perf_counter() - start.wall_time, train_seconds=loop_seconds,
        world_size=run_devices(cfg), flops_per_token=flops_per_token(cfg.model),
        train_losses=s.history[-1]["losses"] if s.history else {},
        valid_losses=s.last_valid_losses, checkpoint=s.last_checkpoint))
    if trainer.ctx.device.type == "xla":
        print_rank_0(training_xla.compilation_report())
    trainer.tensorboard.close()
    trainer.ctx.progress.mark("the end of the run")
    _finish()


_EXIT_MESSAGES = {
    "signal": "{signal} received with --exit-signal-handler",
    "signal-while-writing": "{signal} received while a checkpoint was written in the "
    "background: it was finished first",
    "duration": "--exit-duration-in-mins reached",
    "interval": "--exit-interval reached",
}


def _saved_at_exit(state: TrainState, cfg: RunConfig) -> str:
    if not cfg.checkpoint.save:
        return "no --save given"
    if state.last_saved == state.iteration:
        return "checkpoint saved"
    return f"no checkpoint saved (the latest is iteration {state.last_saved})"


def _exit_message(reason: str, state: TrainState, cfg: RunConfig,
                  signal_name: Optional[str] = None) -> str:
    why = _EXIT_MESSAGES[reason].format(signal=signal_name or "SIGTERM")
    return f"exiting at iteration {state.iteration} ({why}); {_saved_at_exit(state, cfg)}"


def _interrupted_message(state: TrainState, cfg: RunConfig) -> str:
    """The one line of a Ctrl-C: where the run was and which checkpoint is the latest."""
    if not cfg.checkpoint.save:
        latest = "no --save given"
    elif state.last_saved is None:
        latest = f"no checkpoint in --save {cfg.checkpoint.save} from this run"
    else:
        latest = (f"the latest checkpoint is iteration {state.last_saved} in --save "
                  f"{cfg.checkpoint.save}")
    return (f"interrupted (SIGINT, Ctrl-C) after iteration {state.iteration}; {latest}; "
            "resume with --load, or add --exit-signal-handler to save when interrupted")


def _with_xla_spmd_or_exit(cfg: RunConfig, argv: Optional[list[str]],
                           extra_args_provider: Optional[Callable],
                           args_defaults: Optional[dict]) -> RunConfig:
    """``cfg``, or where this process trains several XLA devices with SPMD
    (``training_xla.spmd_devices``) the flags read again with each device a data-parallel
    rank, so that the batch sizes are Megatron's (--micro-batch-size per device, a
    --global-batch-size left out defaulting to it times the devices). Batch sizes the
    devices cannot split end the run with ``error: ...`` naming the flags."""
    devices = training_xla.spmd_devices(cfg)
    if devices is None:
        return cfg
    try:
        return parse_args(argv, extra_args_provider, defaults=args_defaults,
                          xla_spmd_devices=devices, announce=False,
                          checkpoint_settings=checkpoint_model_settings)
    except ConfigError as error:
        refuse(f"XLA SPMD over {devices} devices (--xla-spmd; each device is a data-parallel "
                f"rank): {error}")


def _check_device_support_or_exit(cfg: RunConfig, replica: bool = False) -> None:
    """Flags an XLA device cannot honour, XLA-only flags without one and (``replica``) an XLA
    world PJRT cannot make end the run with ``error: ...`` naming the flag (exit 2) before
    any process group or model exists (``megatron.training_xla``)."""
    if replica and cfg.parallel.xla_spmd_devices:
        return  # one process, every device its own (training_xla.spmd_devices)
    if replica:
        problem = training_xla.unsupported_replica(cfg)
    elif cfg.training.distributed_backend == "xla":
        problem = training_xla.unsupported_on_xla(cfg)
    else:
        problem = training_xla.unsupported_off_xla(cfg)
    if problem is not None:
        refuse(problem)


def _check_checkpoint_folders_or_exit(cfg: RunConfig) -> None:
    """A --load that is a file and a --save that cannot be written are user errors: say so
    (``error: ...``, exit 2) before any process group or model exists."""
    from megatron import checkpointing

    try:
        if cfg.checkpoint.load:
            checkpointing.check_load_dir(cfg.checkpoint.load, cfg.deepspeed.deepspeed,
                                         cfg.checkpoint.universal_checkpoint)
        if cfg.checkpoint.save:
            checkpointing.check_save_dir(cfg.checkpoint.save)
    except checkpointing.CheckpointError as error:
        refuse(str(error))


def _lock_save_folder_or_exit(cfg: RunConfig):
    """Global rank 0 locks --save for this run (megatron/checkpointing/lock.py); a folder
    another live run saves into ends every rank with ``error: ...`` (rank 0) and status 2,
    before the model is built. Returns the lock (rank 0), else None."""
    from megatron.checkpointing.lock import SaveLock
    from megatron.checkpointing.ranks import broadcast_from_rank0

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


def _warn_slow_precision(cfg: RunConfig, device: torch.device) -> None:
    if device.type == "cpu" and (cfg.optimizer.bf16 or cfg.optimizer.fp16):
        print_rank_0(
            "WARNING: --bf16/--fp16 on a CPU: most CPUs have no fast half-precision matmul, "
            "and on an AVX2-only CPU bf16 ran about 35x slower than fp32 (13 vs 490 tokens/s "
            "for a 30M-parameter GPT). Use fp32 on CPU unless you are testing precision.")


def _finish() -> None:
    sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier(group=parallel_state.get_control_group())

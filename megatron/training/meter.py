"""What a run reports as it goes: the history of iterations, the Megatron log line every
--log-interval iterations, TensorBoard (and offline Weights & Biases) scalars, memory, timers,
the pipeline bubble, and the evaluation lines. The formats live in ``megatron.training.log``."""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch.distributed as dist

from megatron.assembly.build import RunContext
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import bubble
from megatron.core.timers import format_across_ranks, gather_across_ranks
from megatron.planning.flops import flops_per_token
from megatron.platform.output import print_rank_0
from megatron.training import xla_step
from megatron.training.engines import StepResult
from megatron.training.log import (
    TensorBoard,
    WandbOffline,
    evaluation_series,
    format_eval,
    format_log_line,
    format_memory_report,
    memory_gb,
    training_series,
)
from megatron.training.state import TrainState, run_devices


class Meter:
    """The run's readings between log lines; ``record`` after every iteration."""

    def __init__(self, ctx: RunContext, optimizer: Any, state: TrainState) -> None:
        self.ctx, self.cfg, self.optimizer, self.state = ctx, ctx.config, optimizer, state
        is_logger = not dist.is_initialized() or dist.get_rank() == 0
        wandb = WandbOffline(self.cfg.logging, self.cfg.checkpoint.save, self.cfg.to_dict(),
                             is_logger)
        self.tensorboard = TensorBoard(self.cfg.logging.tensorboard_dir, is_logger,
                                       self.cfg.logging.tensorboard_queue_size, wandb)
        self._interval: dict[str, float] = {}
        self._interval_iters = self._skipped = self._nan = 0
        self._interval_tokens = 0
        self._interval_start = self._last_iteration_end = time.perf_counter()
        self._memory_reported = False

    def record(self, result: StepResult, gbs: int, train_iters: int,
               num_microbatches: int) -> None:
        """This iteration into the history, the interval's sums, and (at their intervals)
        TensorBoard and the log line."""
        s, losses = self.state, result.losses
        scale = self.optimizer.get_loss_scale()
        s.history.append(dict(iteration=s.iteration, losses=losses, grad_norm=result.grad_norm,
                              skipped=result.skipped, nonfinite=result.nonfinite is not None,
                              loss_scale=float(scale) if scale is not None else None))
        if self.ctx.device.type == "xla":
            xla_step.record_compilations(s.history[-1])
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
            self._log(gbs, result.grad_norm, result.num_zeros, params_norm, train_iters,
                      num_microbatches)

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
        axes = self.axes()
        series = training_series(
            losses, learning_rate=lr, batch_size=gbs, loss_scale=scale, grad_norm=grad_norm,
            num_zeros=num_zeros, world_size=world, iteration_seconds=iteration_seconds,
            logging=cfg.logging)
        if params_norm is not None:
            series["params-norm/params-norm"] = params_norm
        self.tensorboard.series(series, **axes)
        self.tensorboard.axes(**axes)

    def _log(self, gbs: int, grad_norm, num_zeros, params_norm, train_iters: int,
             num_microbatches: int) -> None:
        s, cfg = self.state, self.cfg
        elapsed = time.perf_counter() - self._interval_start
        iters = max(self._interval_iters, 1)
        good = max(self._interval_iters - self._skipped - self._nan, 1)
        losses = {name: total / good for name, total in self._interval.items()}
        lr, scale, world = self._current_readings()
        tgs = self._interval_tokens / max(elapsed, 1e-9) / world
        tflops = tgs * flops_per_token(cfg.model) / 1e12
        print_rank_0(format_log_line(
            iteration=s.iteration, train_iters=train_iters,
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
                stages, num_microbatches, cfg.parallel.virtual_pipeline_model_parallel_size,
                iters))
        # Rates over the logging interval; the per-iteration values go out in record().
        scalars = {"tokens-per-gpu-per-second": tgs, "tflops-per-gpu": tflops,
                   "mem-max-gb": memory_gb(), "iteration-time-ms": 1000.0 * elapsed / iters}
        if cfg.logging.log_timers_to_tensorboard:
            scalars.update({f"timers/{k}": 1000.0 * v / iters for k, v in timings.items()})
        self.tensorboard.scalars(scalars, s.iteration)
        self._interval, self._interval_iters, self._interval_tokens = {}, 0, 0
        self._skipped = self._nan = 0
        self._interval_start = time.perf_counter()

    def axes(self) -> dict[str, int]:
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

    def evaluation(self, prefix: str, losses: dict[str, float], tag: str) -> None:
        """An evaluation's lines (Megatron's) and its TensorBoard values."""
        print_rank_0(format_eval(prefix, losses))
        step = self.state.iteration
        for name, value in losses.items():
            self.tensorboard.scalars({f"{name} {tag}": value,
                                      f"{name} {tag} ppl": math.exp(min(20.0, value))}, step)
        self.tensorboard.series(evaluation_series(
            losses, tag, self.cfg.logging.log_validation_ppl_to_tensorboard), **self.axes())

    def close(self) -> None:
        self.tensorboard.close()

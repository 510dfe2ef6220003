"""The training loop: iterations through the run's step engine until the run's length, an
exit interval or duration, or a signal; evaluation, checkpoints (and the best one), the
non-finite and fp16-overflow guards, manual garbage collection. Engine-free: the engine
(``megatron.training.engines``) does the step, the evaluation pass, the save and the load;
the meter (``megatron.training.meter``) reports."""

from __future__ import annotations

import functools
import gc
import time
from typing import Optional

import torch.distributed as dist

from megatron import checkpointing
from megatron.assembly.build import RunContext
from megatron.checkpointing.async_save import AsyncSaver
from megatron.checkpointing.ranks import any_true
from megatron.core.microbatches import NumMicroBatchesCalculator
from megatron.core.nonfinite import NonFiniteGuard, OverflowGuard
from megatron.platform.output import print_rank_0
from megatron.platform.signals import ShutdownSignals
from megatron.training.engines import (
    StepEngine,
    StepResult,
    advance_schedule,
    empty_cuda_cache,
    evaluate,
)
from megatron.training.meter import Meter
from megatron.training.state import TrainState, data_parallel_size


class Trainer:
    """Holds what the loop needs between iterations; ``train()`` runs to the end or an exit."""

    def __init__(self, ctx: RunContext, engine: StepEngine, iterators, state: TrainState,
                 signals: ShutdownSignals) -> None:
        self.ctx, self.cfg, self.engine = ctx, ctx.config, engine
        self.train_iter, self.valid_iter, self.test_iter = iterators
        # Middle pipeline stages read no data but must join every evaluation.
        self.has_valid = any_true(self.valid_iter is not None)
        self.has_test = any_true(self.test_iter is not None)
        self.state = state
        t = self.cfg.training
        self.calculator = NumMicroBatchesCalculator(
            t.global_batch_size, t.micro_batch_size, data_parallel_size(self.cfg),
            t.rampup_batch_size)
        self.meter = Meter(ctx, engine.optimizer, state)
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

    @property
    def chunks(self) -> list:
        return self.engine.chunks

    @property
    def optimizer(self):
        return self.engine.optimizer

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
            result = self.engine.train_step(self.train_iter, num_micro)
            advance_schedule(self.engine.scheduler, result, num_micro, self.cfg)
            s.iteration += 1
            s.consumed_train_samples += gbs
            empty_cuda_cache(self.ctx, level=1)
            if t.manual_gc and t.manual_gc_interval and s.iteration % t.manual_gc_interval == 0:
                self._collect_garbage()
            self._warn_nonfinite(result.nonfinite)
            self._warn_overflow(result, scale)
            self.meter.record(result, gbs, self.train_iters, num_micro)
            if self.guard.must_stop:
                raise self.guard.stop_error(s.iteration, self.cfg.checkpoint.save,
                                            s.last_saved)
            if self.overflow_guard is not None and self.overflow_guard.must_stop:
                raise self.overflow_guard.stop_error(s.iteration)
            reason = self._after_iteration()
            if reason:
                return reason
        return "done"

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

    def run_evaluation(self, prefix: str, data_iterator, eval_iters: int,
                       has_data: bool = True, tag: Optional[str] = None) -> dict[str, float]:
        if not has_data or eval_iters == 0:
            return {}
        self.ctx.progress.mark(f"the evaluation \"{prefix}\"")
        self._collect_garbage(at_evaluation=True)
        losses = evaluate(self.engine, data_iterator, self.cfg.num_microbatches, eval_iters)
        self._collect_garbage(at_evaluation=True)
        empty_cuda_cache(self.ctx, level=1)
        tag = tag or ("validation" if "valid" in prefix else "test")
        self.meter.evaluation(prefix, losses, tag)
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
            checkpointing.reserve_host_buffers(it, self.chunks, self.optimizer,
                                               self.engine.scheduler, self.cfg, self.saver)
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
            if self.state.last_saved != self.state.iteration and self.engine.records_best:
                self.save(valid_loss=loss)  # recorded as the best when it is published
                return
            self.finish_writing()  # this iteration's folder must exist to be named the best
            if self.save() and (not dist.is_initialized() or dist.get_rank() == 0):
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
            if self.saver is not None:  # signals wait for the background write, from
                self.signals.writing_in_background(True)  # before its thread starts
            # checkpointing logs the save ("successfully saved checkpoint ..."); the run
            # summary names the last folder.
            folder = self.engine.save(s, valid_loss, self.saver)
            s.last_saved, s.last_checkpoint = s.iteration, folder
        return True

"""pretrain(): a run from its flags to its last line. Parse, check (``preflight``), set up
this rank (process groups, the --save lock, the step engine with the model, optimizer and
checkpoint, the data), train (``loop``), end with a summary or the exit's own line. Users
supply three callbacks, as in Megatron (with the run context passed explicitly instead of a
global ``args``)::

    model_provider(ctx, pre_process, post_process, first_layer, num_layers) -> nn.Module
    train_valid_test_datasets_provider(ctx, [n_train, n_valid, n_test]) -> (train, valid, test)
    forward_step(ctx, data_iterator, model, stage) -> (output_tensor, loss_func)

``loss_func(output_tensor) -> (loss, {"lm loss": loss.detach()})``; reported values are
averaged over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.assembly.build import (
    RunContext,
    check_dp_topology_or_exit,
    num_parameters,
    run_vocab_size,
    setup_model_and_optimizer,
)
from megatron.assembly.initialize import initialize_megatron
from megatron.checkpointing.load import checkpoint_model_settings
from megatron.checkpointing.ranks import any_true
from megatron.config import RunConfig, parse_args_or_exit, print_config
from megatron.core import parallel_state, watchdog
from megatron.core.nonfinite import NonFiniteError
from megatron.core.optimizer_param_scheduler import ScheduleMismatchError
from megatron.core.timers import Timers
from megatron.integrations import deepspeed as ds_integration
from megatron.integrations.deepspeed import deepspeed_config_or_exit
from megatron.model.layer_norm import apex_layer_norm_used
from megatron.model.transformer import flash_attn_installed
from megatron.planning.flops import flops_per_token
from megatron.planning.planner import build_plan, format_plan
from megatron.planning.rehearsal.entry import rehearse_or_exit
from megatron.platform import launcher_watch, xla
from megatron.platform.launch_env import free_port
from megatron.platform.output import configure_output, global_rank, print_rank_0, refuse
from megatron.platform.signals import (
    INTERRUPTED_EXIT_STATUS,
    TERMINATED_EXIT_STATUS,
    ShutdownSignals,
)
from megatron.training import xla_step
from megatron.training.data import build_data_iterators
from megatron.training.engines import StepEngine, build_engine
from megatron.training.log import format_run_summary
from megatron.training.loop import Trainer
from megatron.training.preflight import (
    check_checkpoint_folders_or_exit,
    check_device_support_or_exit,
    check_resumed_schedule_or_exit,
    check_run_inputs,
    lock_save_folder_or_exit,
    warn_slow_precision,
    with_xla_spmd_or_exit,
)
from megatron.training.state import TrainState, run_devices


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
    --exit-signal-handler, as SIGTERM does (see megatron/platform/signals.py). A communication that
    times out (--distributed-timeout-minutes) ends the process with one line and status 1; a
    stall prints the stacks (--hang-timeout-minutes; megatron/core/watchdog.py)."""
    wall_start = time.perf_counter()
    launcher_watch.stop_with_launcher()  # first: a worker whose torchrun agent died ends
    cfg = parse_args_or_exit(argv, extra_args_provider, defaults=args_defaults,
                             checkpoint_settings=checkpoint_model_settings)
    callbacks = RunCallbacks(train_valid_test_datasets_provider, model_provider,
                             forward_step_func)
    if cfg.training.rehearse:
        rehearse_or_exit(cfg, rank_starter(callbacks))
    configure_output(cfg.logging.log_all_ranks)
    check_device_support_or_exit(cfg)
    if xla_step.launches_replicas(cfg):
        xla.launch_replicas(
            functools.partial(pretrain, train_valid_test_datasets_provider, model_provider,
                              forward_step_func, extra_args_provider=extra_args_provider,
                              args_defaults=args_defaults, argv=argv),
            cfg.training.xla_processes, cfg.training.mp_start_method, free_port())
        return TrainState()
    cfg = with_xla_spmd_or_exit(cfg, argv, extra_args_provider, args_defaults)
    check_device_support_or_exit(cfg, replica=True)
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
    check_checkpoint_folders_or_exit(cfg)
    check_dp_topology_or_exit(cfg)
    tokenizer = check_run_inputs(cfg)
    ds_config = deepspeed_config_or_exit(cfg)
    check_resumed_schedule_or_exit(cfg, ds_config)
    if cfg.training.dry_run:
        return _dry_run(cfg.with_vocab_size(run_vocab_size(cfg, tokenizer)))
    trainer = start_run(cfg, tokenizer, ds_config, callbacks, state, signals, progress)
    if cfg.training.eval_only:
        trainer.evaluate_only()
        trainer.meter.close()
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
        trainer.meter.close()
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
    save_lock = lock_save_folder_or_exit(cfg)
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
    warn_slow_precision(cfg, ctx.device)
    if cfg.model.use_flash_attn and not flash_attn_installed():
        print_rank_0("> --use-flash-attn: the flash_attn package is not installed; attention "
                     "runs through PyTorch's scaled_dot_product_attention (its flash kernel on "
                     "a GPU in bf16/fp16)")

    forward_step = functools.partial(callbacks.forward_step, ctx)
    engine = _build_engine(cfg, ctx, callbacks, forward_step, ds_config)
    print_rank_0(f" > number of parameters on (tensor, pipeline) model parallel rank "
                 f"({parallel_state.get_tensor_model_parallel_rank()}, "
                 f"{parallel_state.get_pipeline_model_parallel_rank()}): "
                 f"{num_parameters(engine.chunks)}")
    if cfg.checkpoint.load:
        try:
            engine.load(state, _eval_only_load(cfg))
        except ScheduleMismatchError as error:  # one the start-up check could not read ahead
            refuse(f"--load {cfg.checkpoint.load}: {error}")  # every rank has the same state
    iterators = build_data_iterators(callbacks.datasets_provider, ctx, state)
    trainer = Trainer(ctx, engine, iterators, state, signals)
    trainer.save_lock = save_lock
    return trainer


def _build_engine(cfg: RunConfig, ctx: RunContext, callbacks: RunCallbacks,
                  forward_step: Callable, ds_config: Optional[dict]) -> StepEngine:
    """This rank's model chunks, optimizer and schedule inside the run's step engine:
    DeepSpeed's (with ``ds_config``) or ours."""
    if ds_config is not None:
        run = ds_integration.setup_engine(callbacks.model_provider, ctx, ds_config)
        return build_engine(ctx, forward_step, run.chunks, run.optimizer, run.scheduler, run)
    chunks, optimizer, scheduler = setup_model_and_optimizer(callbacks.model_provider, ctx)
    return build_engine(ctx, forward_step, chunks, optimizer, scheduler)

def _dry_run(cfg: RunConfig) -> TrainState:
    """--dry-run: print the run's plan (megatron/planning/planner.py, as tools/plan.py does), judged
    against this machine's GPU memory where there is a GPU, and train nothing."""
    gpu_gb = None
    if torch.cuda.is_available() and not cfg.training.use_cpu:
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    print_rank_0(format_plan(build_plan(cfg, cfg.deepspeed.zero_stage or 0, gpu_gb)))
    return TrainState()

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
        print_rank_0(xla_step.compilation_report())
    trainer.meter.close()
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

def _finish() -> None:
    sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier(group=parallel_state.get_control_group())

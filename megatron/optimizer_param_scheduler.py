"""Learning-rate warmup/decay and weight-decay increment, with Megatron's checkpoint rules.

Steps are whatever the caller counts: Megatron counts *samples* (each iteration calls
``step(global_batch_size)``), so warmup and decay lengths are in samples too; see
``build_optimizer_param_scheduler``. Megatron-DeepSpeed's token-based decay
(``--lr-decay-tokens``, ``--lr-warmup-tokens``) needs ``step(increment, token_num=consumed
tokens)``.

Learning rate at step ``n`` (warmup ``W``, decay ``D``, both in steps):

- ``n <= W`` (W > 0): linear from ``init_lr`` to ``max_lr``;
- ``constant``: ``max_lr``;  ``n > D``: ``min_lr``;
- ``inverse-square-root``: ``max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
- ``linear`` / ``cosine``: from ``max_lr`` at ``W`` to ``min_lr`` at ``D``.

Loading a checkpoint: with ``override_opt_param_scheduler`` the constructor's values win;
with ``use_checkpoint_opt_param_scheduler`` the checkpoint's values win; with neither, a
difference that changes a learning rate or weight decay is a ``ScheduleMismatchError`` naming
each value, the flags that set it, and both flags. Differences that change nothing are taken
from this run (the weight-decay increment length when the weight decay is constant, the decay
length of a constant learning rate): a longer ``--train-iters`` with ``--lr-decay-iters`` set
resumes as it is.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Optional

from megatron.config import ConfigError, OptimizerConfig, SchedulerConfig

logger = logging.getLogger(__name__)

# Per checked value: what it is, and the flags that set it (for the mismatch message).
_VALUES = {
    "max_lr": ("learning rate", "--lr"),
    "min_lr": ("minimum learning rate", "--min-lr"),
    "init_lr": ("initial warmup learning rate", "--lr-warmup-init"),
    "lr_warmup_steps": ("warmup length", "--lr-warmup-iters / --lr-warmup-fraction / "
                        "--lr-warmup-samples"),
    "lr_decay_steps": ("decay length", "--lr-decay-iters / --lr-decay-samples (default: "
                       "--train-iters / --train-samples)"),
    "lr_decay_style": ("decay style", "--lr-decay-style"),
    "lr_decay_tokens": ("decay length in tokens", "--lr-decay-tokens"),
    "lr_warmup_tokens": ("warmup length in tokens", "--lr-warmup-tokens"),
    "start_wd": ("start weight decay", "--start-weight-decay / --weight-decay"),
    "end_wd": ("end weight decay", "--end-weight-decay / --weight-decay"),
    "wd_incr_steps": ("weight-decay increment length", "--train-iters / --train-samples"),
    "wd_incr_style": ("weight-decay increment style", "--weight-decay-incr-style"),
}
# Lengths counted in scheduler steps (samples in Megatron), shown in iterations when known.
_LENGTHS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


class ScheduleMismatchError(ConfigError):
    """The checkpoint's schedule differs from this run's flags, and neither
    --override-opt_param-scheduler nor --use-checkpoint-opt_param-scheduler says which wins.

    ``mismatches``: ``(name, this run's value, the checkpoint's)`` per differing value.
    """

    def __init__(self, mismatches: list[tuple[str, Any, Any]], samples_per_iteration: int = 0):
        self.mismatches = mismatches
        parts = [_describe(name, ours, saved, samples_per_iteration)
                 for name, ours, saved in mismatches]
        super().__init__(
            f"the checkpoint's learning-rate schedule differs from this run's flags: "
            f"{'; '.join(parts)}. Pass --use-checkpoint-opt_param-scheduler to continue the "
            "checkpoint's schedule, or --override-opt_param-scheduler to follow these flags "
            "from the checkpoint's position")


def _describe(name: str, ours: Any, saved: Any, samples_per_iteration: int) -> str:
    what, flags = _VALUES[name]
    unit = ""
    if name in _LENGTHS:
        per = samples_per_iteration
        if per and ours % per == 0 and saved % per == 0:
            ours, saved, unit = ours // per, saved // per, " iterations"
        else:
            unit = " samples"
    return f"{what} {_number(ours)}{unit} here, {_number(saved)} in the checkpoint ({flags})"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every optimizer param group on each ``step``.

    A group's ``lr_mult`` and ``wd_mult`` (default 1) multiply the scheduled values.
    """

    def __init__(self, optimizer: Any, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: float, lr_decay_steps: float, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: float, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = False,
                 override_opt_param_scheduler: bool = False,
                 lr_warmup_tokens: Optional[int] = None,
                 lr_decay_tokens: Optional[int] = None,
                 samples_per_iteration: int = 0) -> None:
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.lr_warmup_tokens = lr_warmup_tokens
        self.lr_decay_tokens = lr_decay_tokens
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        # Steps per iteration of an iteration-based run (its messages speak in iterations).
        self.samples_per_iteration = samples_per_iteration
        self.num_steps = 0
        self.num_tokens = 0
        # Step-based warmup with token-based decay: the decay starts at the token count seen
        # when warmup ended.
        self.decay_start_tokens: Optional[int] = None
        self._validate()
        self.step(0)
        if optimizer.param_groups:  # not for a scheduler built only to compare schedules
            logger.info("learning rate decay style: %s", self.lr_decay_style)

    def _validate(self) -> None:
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ConfigError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.max_lr})")
        if self.init_lr > self.max_lr:
            raise ConfigError(f"--lr-warmup-init ({self.init_lr}) is larger than --lr ({self.max_lr})")
        if self.lr_decay_steps <= 0:
            raise ConfigError(f"learning-rate decay length must be positive, got {self.lr_decay_steps}")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ConfigError(f"learning-rate warmup ({self.lr_warmup_steps}) must be shorter "
                              f"than the decay ({self.lr_decay_steps})")
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ConfigError(f"need 0 <= --start-weight-decay ({self.start_wd}) <= "
                              f"--end-weight-decay ({self.end_wd})")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ConfigError("--weight-decay-incr-style constant needs --start-weight-decay "
                              f"({self.start_wd}) == --end-weight-decay ({self.end_wd})")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler are mutually exclusive")

    # Schedules -------------------------------------------------------------------------------

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        else:
            raise ConfigError(f"unknown --weight-decay-incr-style {self.wd_incr_style!r}")
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _warmup_lr(self) -> Optional[float]:
        """The warmup learning rate, or None once warmup is over."""
        if self.lr_warmup_tokens is not None:
            if self.lr_warmup_tokens > 0 and self.num_tokens <= self.lr_warmup_tokens:
                frac = float(self.num_tokens) / float(self.lr_warmup_tokens)
                return self.init_lr + (self.max_lr - self.init_lr) * frac
            return None
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            frac = float(self.num_steps) / float(self.lr_warmup_steps)
            return self.init_lr + (self.max_lr - self.init_lr) * frac
        return None

    def _progress(self) -> tuple[float, float, float]:
        """(position, warmup end, decay end) in tokens when decaying by tokens, else steps."""
        if self.lr_decay_tokens is None:
            return float(self.num_steps), float(self.lr_warmup_steps), float(self.lr_decay_steps)
        if self.lr_warmup_tokens is not None:
            warmup = self.lr_warmup_tokens
        else:
            warmup = self.decay_start_tokens if self.decay_start_tokens is not None else self.num_tokens
        return float(self.num_tokens), float(warmup), float(self.lr_decay_tokens)

    def get_lr(self) -> float:
        """Learning rate at the current step (see the module docstring)."""
        warmup_lr = self._warmup_lr()
        if warmup_lr is not None:
            return warmup_lr
        if self.lr_decay_style == "constant":
            return self.max_lr
        position, warmup_end, decay_end = self._progress()
        if position > decay_end:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = self.max_lr * math.sqrt(max(warmup_end, 1.0)) / math.sqrt(max(position, 1.0))
            return max(self.min_lr, lr)
        ratio = (position - warmup_end) / (decay_end - warmup_end)
        ratio = min(max(ratio, 0.0), 1.0)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ConfigError(f"unknown --lr-decay-style {self.lr_decay_style!r}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: float, token_num: Optional[int] = None) -> None:
        """Advance by ``increment`` steps (samples, in Megatron) and set lr/wd on the groups."""
        self.num_steps += increment
        if token_num is not None:
            self.num_tokens = token_num
        if (self.lr_decay_tokens is not None and self.lr_warmup_tokens is None
                and self.decay_start_tokens is None and self.num_steps >= self.lr_warmup_steps):
            self.decay_start_tokens = self.num_tokens
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    # Checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Megatron(-DeepSpeed)'s keys, plus ``init_lr`` and ``decay_start_tokens``."""
        return {
            "max_lr": self.max_lr,
            "init_lr": self.init_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_warmup_tokens": self.lr_warmup_tokens,
            "num_steps": self.num_steps,
            "num_tokens": self.num_tokens,
            "decay_start_tokens": self.decay_start_tokens,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_tokens": self.lr_decay_tokens,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _schedule_values(self, sd: dict) -> dict[str, Any]:
        """The checkpoint's schedule settings by our attribute names (older Megatron key
        names accepted: start_lr, warmup_iter, warmup_steps, end_iter, decay_steps,
        decay_style, decay_tokens, warmup_tokens)."""

        def first(*keys: str) -> Any:
            return next((sd[k] for k in keys if k in sd), None)

        saved = {"max_lr": first("start_lr", "max_lr"), "min_lr": sd["min_lr"],
                 "lr_warmup_steps": first("warmup_iter", "warmup_steps", "lr_warmup_steps"),
                 "lr_decay_steps": first("end_iter", "decay_steps", "lr_decay_steps"),
                 "lr_decay_style": first("decay_style", "lr_decay_style")}
        if "init_lr" in sd:
            saved["init_lr"] = sd["init_lr"]
        if "lr_decay_tokens" in sd or "decay_tokens" in sd:
            saved["lr_decay_tokens"] = first("lr_decay_tokens", "decay_tokens")
        saved_warmup = first("lr_warmup_tokens", "warmup_tokens")
        # Megatron-DeepSpeed stores the token count at the end of step-based warmup in
        # lr_warmup_tokens: a position, not a setting, so it is not compared.
        if "decay_start_tokens" in sd or self.lr_warmup_tokens is not None \
                or saved_warmup is None:
            saved["lr_warmup_tokens"] = saved_warmup
        if "start_wd" in sd:
            for name in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
                saved[name] = sd[name]
        return saved

    def _without_effect(self, name: str, saved: dict) -> bool:
        """Whether a difference in ``name`` changes no learning rate or weight decay, in this
        run's schedule and the checkpoint's: then it is not an error (this run's is kept)."""
        if name == "wd_incr_steps":
            constant = {self.wd_incr_style, saved["wd_incr_style"]} == {"constant"} or (
                self.start_wd == self.end_wd == saved["start_wd"] == saved["end_wd"])
            return constant
        if name == "lr_decay_steps":
            return self.lr_decay_style == saved["lr_decay_style"] == "constant"
        return False

    def _resolve(self, saved: dict) -> dict[str, Any]:
        """Megatron's rule for each value: override -> this run's, use-checkpoint -> the
        checkpoint's, neither -> they must agree (``ScheduleMismatchError`` otherwise)."""
        if self.override_opt_param_scheduler:
            logger.info("--override-opt_param-scheduler: the schedule follows the flags")
            return {name: getattr(self, name) for name in saved}
        if self.use_checkpoint_opt_param_scheduler:
            logger.info("--use-checkpoint-opt_param-scheduler: the schedule is the checkpoint's")
            return dict(saved)
        mismatches = [(name, getattr(self, name), value) for name, value in saved.items()
                      if getattr(self, name) != value and not self._without_effect(name, saved)]
        if mismatches:
            raise ScheduleMismatchError(mismatches, self.samples_per_iteration)
        return {name: getattr(self, name) for name in saved}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the position; schedule values follow ``_resolve``."""
        sd = state_dict
        resolved = self._resolve(self._schedule_values(sd))
        for name, value in resolved.items():
            setattr(self, name, value)
        if "lr_warmup_tokens" not in resolved:  # Megatron-DeepSpeed's position (see above)
            self.decay_start_tokens = sd.get("lr_warmup_tokens", sd.get("warmup_tokens"))
        else:
            self.decay_start_tokens = sd.get("decay_start_tokens")
        self.num_steps = 0  # the checkpoint's position replaces ours, it is not added to it
        position = next(sd[k] for k in ("num_iters", "num_steps") if k in sd)
        self.step(position, token_num=sd.get("num_tokens", self.num_tokens))


def build_optimizer_param_scheduler(scheduler_config: SchedulerConfig,
                                    optimizer_config: OptimizerConfig, optimizer: Any, *,
                                    global_batch_size: int, train_iters: Optional[int] = None,
                                    train_samples: Optional[int] = None) -> OptimizerParamScheduler:
    """The scheduler for an iteration- or sample-based run, counted in samples as in Megatron.

    Iteration-based (``--train-iters``): decay over ``--lr-decay-iters`` (default train
    iters) x global batch, warmup ``--lr-warmup-fraction`` of that or ``--lr-warmup-iters`` x
    global batch. Sample-based (``--train-samples``): the same with the ``-samples`` flags.
    The weight decay increases over the whole run. The training loop then calls
    ``scheduler.step(global_batch_size)`` once per iteration.
    """
    sc, oc = scheduler_config, optimizer_config
    if oc.lr is None:
        raise ConfigError("--lr is required to build the learning-rate scheduler")
    if (train_iters is None) == (train_samples is None):
        raise ConfigError("exactly one of --train-iters and --train-samples must be given")
    if train_iters is not None:
        if sc.lr_decay_samples is not None or sc.lr_warmup_samples:
            raise ConfigError("--train-iters needs iteration-based --lr-decay-iters / "
                              "--lr-warmup-iters, not the -samples flags")
        decay_steps = (sc.lr_decay_iters or train_iters) * global_batch_size
        wd_incr_steps = train_iters * global_batch_size
        warmup_steps = sc.lr_warmup_iters * global_batch_size
    else:
        if sc.lr_decay_iters is not None or sc.lr_warmup_iters:
            raise ConfigError("--train-samples needs sample-based --lr-decay-samples / "
                              "--lr-warmup-samples, not the -iters flags")
        decay_steps = sc.lr_decay_samples or train_samples
        wd_incr_steps = train_samples
        warmup_steps = sc.lr_warmup_samples
    if sc.lr_warmup_fraction is not None:
        warmup_steps = sc.lr_warmup_fraction * decay_steps
    start_wd = oc.weight_decay if sc.start_weight_decay is None else sc.start_weight_decay
    end_wd = oc.weight_decay if sc.end_weight_decay is None else sc.end_weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=sc.lr_warmup_init, max_lr=oc.lr, min_lr=oc.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=sc.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=wd_incr_steps, wd_incr_style=sc.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=sc.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=sc.override_opt_param_scheduler,
        lr_warmup_tokens=sc.lr_warmup_tokens, lr_decay_tokens=sc.lr_decay_tokens,
        samples_per_iteration=global_batch_size if train_iters is not None else 0,
    )


class _NoParameters:
    """An optimizer without parameters: what a scheduler built only to be compared needs."""

    param_groups: list = []


def check_resumed_schedule_or_exit(cfg: Any, ds_config: Optional[dict]) -> None:
    """A ``--load`` whose schedule differs from this run's flags (another --lr, a longer
    --train-iters that moves the decay) ends the run before any process group or model
    exists: ``error: ...`` on rank 0 naming each value, its flags and the flag that resolves
    it (exit status 2), instead of a ``ScheduleMismatchError`` on every rank at the load. The
    same rule as the load: a scheduler built from the flags loads the checkpoint's state."""
    from megatron import checkpointing
    from megatron.utils import global_rank

    ck, sc = cfg.checkpoint, cfg.scheduler
    if (not ck.load or ck.finetune or ck.no_load_optim or ck.no_load_lr_state
            or sc.override_opt_param_scheduler or sc.use_checkpoint_opt_param_scheduler
            or (ds_config is not None and "scheduler" in ds_config)):
        return
    from megatron.checkpointing.folder import DEEPSPEED, MEGATRON

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
        if global_rank() == 0:
            print(f"error: --load {ck.load}: {folder}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None

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
with ``use_checkpoint_opt_param_scheduler`` the checkpoint's values win; with neither, any
difference is an error that names the value and both flags.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from megatron.config import ConfigError, OptimizerConfig, SchedulerConfig

logger = logging.getLogger(__name__)


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
                 lr_decay_tokens: Optional[int] = None) -> None:
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
        self.num_steps = 0
        self.num_tokens = 0
        # Step-based warmup with token-based decay: the decay starts at the token count seen
        # when warmup ended.
        self.decay_start_tokens: Optional[int] = None
        self._validate()
        self.step(0)
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

    def _check_and_set(self, current: Any, saved: Any, what: str) -> Any:
        """Megatron's rule for one value: override -> current, else checkpoint (checked)."""
        if self.override_opt_param_scheduler:
            logger.info("overriding %s value to %s", what, current)
            return current
        if not self.use_checkpoint_opt_param_scheduler and current != saved:
            raise ValueError(
                f"OptimizerParamScheduler: the {what} from the arguments ({current}) differs "
                f"from the checkpoint ({saved}); pass --override-opt_param-scheduler to use the "
                "arguments or --use-checkpoint-opt_param-scheduler to use the checkpoint")
        logger.info("using checkpoint value %s for %s", saved, what)
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the position; schedule values follow ``_check_and_set``.

        Accepts the older key names Megatron checkpoints carry (start_lr, warmup_iter,
        warmup_steps, end_iter, decay_steps, decay_style, num_iters).
        """
        sd = state_dict

        def first(*keys: str, default: Any = None) -> Any:
            return next((sd[k] for k in keys if k in sd), default)

        self.max_lr = self._check_and_set(self.max_lr, first("start_lr", "max_lr"), "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        if "init_lr" in sd:
            self.init_lr = self._check_and_set(self.init_lr, sd["init_lr"], "initial warmup learning rate")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, first("warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "warmup iterations")
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, first("end_iter", "decay_steps", "lr_decay_steps"),
            "total number of iterations")
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, first("decay_style", "lr_decay_style"), "learning rate decay style")
        self._load_token_state(sd)
        self.num_steps = 0  # the checkpoint's position replaces ours, it is not added to it
        self.step(first("num_iters", "num_steps"), token_num=sd.get("num_tokens", self.num_tokens))
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps, sd["wd_incr_steps"], "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, sd["wd_incr_style"], "weight decay incr style")
            self.step(0)

    def _load_token_state(self, sd: dict) -> None:
        if "lr_decay_tokens" in sd or "decay_tokens" in sd:
            saved = sd.get("lr_decay_tokens", sd.get("decay_tokens"))
            self.lr_decay_tokens = self._check_and_set(self.lr_decay_tokens, saved, "decay tokens")
        saved_warmup = sd.get("lr_warmup_tokens", sd.get("warmup_tokens"))
        if "decay_start_tokens" not in sd and self.lr_warmup_tokens is None and saved_warmup is not None:
            # Megatron-DeepSpeed stores the token count at the end of step-based warmup in
            # lr_warmup_tokens; it is a position, not a setting, so it is not checked.
            self.decay_start_tokens = saved_warmup
        else:
            self.lr_warmup_tokens = self._check_and_set(self.lr_warmup_tokens, saved_warmup,
                                                        "warmup tokens")
            self.decay_start_tokens = sd.get("decay_start_tokens")


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
    )

"""The optimizer slice (optimizer, loss scaling, gradient reduction) and the learning-rate and
weight-decay schedule slice, with Megatron's flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.config.base import (
    Slice,
    flag,
    non_negative,
    one_of,
    option,
    optional_positive,
    positive,
    precision_dtype,
    probability,
    received,
    require,
    set_field,
)

OPTIMIZERS = ("adam", "sgd", "accumadamw")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerConfig(Slice):
    """Optimizer, loss scaling and gradient reduction.

    ``lr`` may stay None for runs that build no optimizer; building one without it raises.
    With ``--bf16`` gradients are accumulated and reduced in fp32, as in Megatron.
    """

    optimizer: str = option(default="adam", choices=OPTIMIZERS,
                            help="adam (decoupled weight decay, i.e. AdamW), sgd, or accumadamw "
                            "(AdamW whose moments take the mean gradient of every "
                            "--accum-steps steps; for --dp-mode decentralized).")
    accum_steps: int = option(default=8, help="--optimizer accumadamw: steps whose mean "
                              "gradient updates the moment estimates at once.")
    lr: Optional[float] = option(default=None, help="Peak learning rate (required to train).")
    min_lr: float = option(default=0.0, help="Learning rate at the end of the decay.")
    weight_decay: float = option(default=0.01, help="Decoupled weight decay (biases and norms "
                                 "excluded).")
    adam_beta1: float = option(default=0.9, help="Adam's first-moment decay.")
    adam_beta2: float = option(default=0.999, help="Adam's second-moment decay.")
    adam_eps: float = option(default=1e-8, help="Adam's epsilon.")
    sgd_momentum: float = option(default=0.9, help="SGD's momentum.")
    clip_grad: float = option(default=1.0, help="Clip the global L2 gradient norm to this "
                              "(0: no clipping).")
    check_for_nan_in_loss_and_grad: bool = option(
        "--check-for-nan-in-loss-and-grad", default=True,
        action=argparse.BooleanOptionalAction, help="Skip (never apply or save) a step whose "
        "loss or gradient norm is NaN/Inf; on by default, "
        "--no-check-for-nan-in-loss-and-grad turns it off.")
    use_syncfree_optim: bool = option(
        default=False, help="On an XLA device: torch_xla's sync-free AdamW/SGD, which skip a "
        "NaN/Inf step on the device (no host read decides it).")
    loss_scale: Optional[float] = option(
        default=None, help="Static loss scale (fp16); dynamic loss scaling when unset.")
    initial_loss_scale: float = option(default=2.0**32, help="First dynamic loss scale.")
    min_loss_scale: float = option(default=1.0, help="Smallest dynamic loss scale.")
    loss_scale_window: int = option(default=1000, help="Steps without overflow before the "
                                    "dynamic loss scale doubles.")
    hysteresis: int = option(default=2, help="Overflows tolerated before the dynamic loss "
                             "scale halves.")
    accumulate_allreduce_grads_in_fp32: bool = option(
        default=False, help="Accumulate and all-reduce gradients in fp32 (always on with "
        "--bf16).")
    use_distributed_optimizer: bool = option(
        default=False, help="Shard the optimizer state and main weights over data parallel "
        "(ZeRO-1 style).")
    overlap_grad_reduce: bool = option(
        default=False, help="Start each gradient bucket's reduction during the backward pass.")
    gradient_accumulation_fusion: bool = option(
        "--no-gradient-accumulation-fusion", default=True, action="store_false",
        help="Return weight gradients to autograd (added into the gradient buffer by a hook) "
        "instead of adding them into the buffer inside the backward's matmul.")
    ddp_bucket_size: Optional[int] = option(
        default=None, help="Gradient elements per all-reduce bucket (one bucket per buffer "
        "when unset).")
    fp16: bool = received("model.fp16", False)
    bf16: bool = received("model.bf16", False)
    log_num_zeros_in_grad: bool = received("logging.log_num_zeros_in_grad", False)

    def __post_init__(self) -> None:
        one_of(self, "optimizer", OPTIMIZERS)
        non_negative(self, "lr", "min_lr", "weight_decay", "clip_grad")
        if self.lr is not None:
            require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) is larger than "
                    f"--lr ({self.lr})")
        probability(self, "adam_beta1", "adam_beta2", "sgd_momentum")
        positive(self, "accum_steps", "adam_eps", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                 "hysteresis")
        optional_positive(self, "loss_scale", "ddp_bucket_size")
        require(self.min_loss_scale <= self.initial_loss_scale,
                f"--min-loss-scale ({self.min_loss_scale}) is larger than "
                f"--initial-loss-scale ({self.initial_loss_scale})")
        if self.bf16 and not self.accumulate_allreduce_grads_in_fp32:
            # bf16 has too few mantissa bits to sum micro-batch gradients (Megatron does this too).
            set_field(self, "accumulate_allreduce_grads_in_fp32", True)

    @property
    def params_dtype(self):
        """The model's dtype, from the precision switches this slice receives."""
        return precision_dtype(self.fp16, self.bf16)


@dataclass(frozen=True)
class SchedulerConfig(Slice):
    """Learning-rate warm-up/decay and weight-decay increment.

    Lengths are in iterations, samples or (Megatron-DeepSpeed) tokens;
    ``megatron.core.optimizer_param_scheduler.build_optimizer_param_scheduler`` resolves them
    against ``--train-iters`` or ``--train-samples``. ``start/end_weight_decay`` default to
    ``--weight-decay``.
    """

    lr_decay_style: str = option(default="linear", choices=LR_DECAY_STYLES,
                                 help="Shape of the learning-rate decay after warm-up.")
    lr_decay_iters: Optional[int] = option(
        default=None, help="Iterations of the decay (--train-iters when unset).")
    lr_decay_samples: Optional[int] = option(
        default=None, help="Samples of the decay (--train-samples when unset).")
    lr_decay_tokens: Optional[int] = option(
        default=None, help="Tokens of the decay (Megatron-DeepSpeed); off when unset.")
    lr_warmup_fraction: Optional[float] = option(
        default=None, help="Warm-up as a fraction of the decay length; off when unset.")
    lr_warmup_iters: int = option(default=0, help="Iterations of linear warm-up.")
    lr_warmup_samples: int = option(default=0, help="Samples of linear warm-up.")
    lr_warmup_tokens: Optional[int] = option(
        default=None, help="Tokens of linear warm-up (Megatron-DeepSpeed); off when unset.")
    lr_warmup_init: float = option(default=0.0, help="Learning rate at the start of warm-up.")
    start_weight_decay: Optional[float] = option(
        default=None, help="Weight decay at the start (--weight-decay-incr-style linear or "
        "cosine; --weight-decay when unset).")
    end_weight_decay: Optional[float] = option(
        default=None, help="Weight decay at the end (linear or cosine increment).")
    weight_decay_incr_style: str = option(default="constant", choices=WD_INCR_STYLES,
                                          help="How the weight decay moves over the run.")
    override_opt_param_scheduler: bool = option(
        "--override-opt_param-scheduler", "--override-lr-scheduler", default=False,
        help="On load, take the schedule from these flags, not from the checkpoint.")
    use_checkpoint_opt_param_scheduler: bool = option(
        "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler", default=False,
        help="On load, take the schedule from the checkpoint, not from these flags.")

    def __post_init__(self) -> None:
        one_of(self, "lr_decay_style", LR_DECAY_STYLES)
        one_of(self, "weight_decay_incr_style", WD_INCR_STYLES)
        optional_positive(self, "lr_decay_iters", "lr_decay_samples", "lr_decay_tokens")
        non_negative(self, "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init",
                     "lr_warmup_tokens", "start_weight_decay", "end_weight_decay")
        require(self.lr_decay_iters is None or self.lr_decay_samples is None,
                "--lr-decay-iters and --lr-decay-samples are mutually exclusive")
        require(self.lr_warmup_iters == 0 or self.lr_warmup_samples == 0,
                "--lr-warmup-iters and --lr-warmup-samples are mutually exclusive")
        if self.lr_warmup_fraction is not None:
            require(0.0 <= self.lr_warmup_fraction <= 1.0,
                    f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}")
            for name in ("lr_warmup_iters", "lr_warmup_samples"):
                require(not getattr(self, name), f"--lr-warmup-fraction and {flag(name)} "
                        f"({getattr(self, name)}) are mutually exclusive")
        given = self.start_weight_decay is not None or self.end_weight_decay is not None
        if self.weight_decay_incr_style == "constant":
            require(not given, "--start-weight-decay/--end-weight-decay need "
                    "--weight-decay-incr-style linear or cosine")
        else:
            require(self.start_weight_decay is not None and self.end_weight_decay is not None,
                    f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                    "--start-weight-decay and --end-weight-decay")
        require(not (self.override_opt_param_scheduler
                     and self.use_checkpoint_opt_param_scheduler),
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                "are mutually exclusive")


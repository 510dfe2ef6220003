"""The logging slice: what is logged, how often, and where (stdout, TensorBoard, wandb)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from megatron.config.base import Slice, check_refused, one_of, option, positive, require

# How timers are reported across ranks (--timing-log-option; megatron/core/timers.py reports them).
TIMING_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass(frozen=True)
class LoggingConfig(Slice):
    """What is logged, how often, and where (stdout, TensorBoard)."""

    log_interval: int = option(default=100, help="Iterations between log lines.")
    tensorboard_dir: Optional[str] = option(
        default=None, help="Write TensorBoard events here; none when unset.")
    tensorboard_log_interval: int = option(
        default=1, help="Iterations between TensorBoard writes of the training scalars.")
    tensorboard_queue_size: int = option(
        default=1000, help="Events TensorBoard's writer buffers before it flushes.")
    log_timers_to_tensorboard: bool = option(default=False, help="Also write the timers.")
    log_batch_size_to_tensorboard: bool = option(
        default=False, help="Also write the global batch size.")
    log_validation_ppl_to_tensorboard: bool = option(
        default=False, help="Also write the validation perplexity.")
    timing_log_level: int = option(
        default=0, choices=(0, 1, 2), help="Timers to report: 0 the iteration time; 1 also "
        "the main phases; 2 everything.")
    timing_log_option: str = option(
        default="minmax", choices=TIMING_LOG_OPTIONS,
        help="How timers are reported across ranks: max, minmax or all.")
    log_params_norm: bool = option(default=False, help="Log the L2 norm of the parameters.")
    log_num_zeros_in_grad: bool = option(default=False,
                                         help="Log the number of zero gradient entries.")
    log_bubble: bool = option(default=False, help="Log the pipeline bubble time per "
                              "iteration.")
    log_loss_scale_to_tensorboard: bool = option(
        "--no-log-loss-scale-to-tensorboard", default=True, action="store_false",
        help="Do not write the loss scale to TensorBoard.")
    log_world_size_to_tensorboard: bool = option(default=False,
                                                 help="Also write the world size.")
    log_all_ranks: bool = option(
        default=False, help="Print messages on every rank, each line prefixed by [rank N] "
        "(otherwise once, from global rank 0; a warning only another rank meets then shows "
        "only with this flag).")
    wandb_project: Optional[str] = option(
        default=None, help="Also log the TensorBoard scalars to this Weights & Biases project, "
        "offline (pip install 'megatron-gpt[wandb]'; wandb sync uploads the run later).")
    wandb_exp_name: Optional[str] = option(default=None, help="The wandb run's name.")
    wandb_save_dir: Optional[str] = option(
        default=None, help="Folder of the offline wandb run (default: --save/wandb, else "
        "--tensorboard-dir/wandb).")

    def __post_init__(self) -> None:
        check_refused(self)
        positive(self, "log_interval", "tensorboard_log_interval", "tensorboard_queue_size")
        one_of(self, "timing_log_level", (0, 1, 2))
        one_of(self, "timing_log_option", TIMING_LOG_OPTIONS)
        require(self.wandb_project or not (self.wandb_exp_name or self.wandb_save_dir),
                "--wandb-exp-name and --wandb-save-dir need --wandb-project")
        require(not self.wandb_project or importlib.util.find_spec("wandb") is not None,
                "--wandb-project needs the wandb package, which is not installed: pip install "
                "'megatron-gpt[wandb]' (or pip install wandb), or drop --wandb-project")

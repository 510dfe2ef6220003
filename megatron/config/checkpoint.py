"""The checkpoint slice: where checkpoints are saved to and loaded from, and what they hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config.base import Slice, check_refused, one_of, option, optional_positive, require


@dataclass(frozen=True)
class CheckpointConfig(Slice):
    """Where checkpoints are saved to and loaded from, and what they hold."""

    save: Optional[str] = option(default=None, help="Folder to save checkpoints in: every "
                                 "--save-interval iterations and at the end of training (only "
                                 "at the end without --save-interval); nothing is saved when "
                                 "unset.")
    load: Optional[str] = option(default=None, help="Folder to resume from (its latest "
                                 "checkpoint); a fresh start when unset.")
    save_interval: Optional[int] = option(default=None, help="Iterations between saves "
                                          "(with --save; unset: one save at the end).")
    no_save_optim: bool = option(default=False, help="Save weights without optimizer state.")
    no_save_rng: bool = option(default=False, help="Save without the random-number states.")
    no_load_optim: bool = option(default=False, help="Load weights; start the optimizer "
                                 "afresh.")
    no_load_rng: bool = option(default=False, help="Do not restore the random-number states.")
    no_load_lr_state: bool = option(
        default=False, help="Load the optimizer but not the learning-rate schedule's state "
        "(Megatron-DeepSpeed): the schedule starts again from these flags.")
    finetune: bool = option(default=False, help="Load weights only and start at iteration 0 "
                            "(no optimizer, schedule or RNG state).")
    keep_last_n_checkpoints: Optional[int] = option(
        default=None, help="Delete older checkpoints, keeping this many (all when unset).")
    save_best: bool = option(default=False, help="Also keep the checkpoint with the lowest "
                             "validation loss (best_checkpointed_iteration.txt).")
    use_checkpoint_args: bool = option(
        default=False, settings_source=True, help="Take the model's shape (--num-layers, "
        "--hidden-size, ...) from the checkpoint in --load; flags given still win.")
    universal_checkpoint: bool = option(
        default=False, help="--load is a DeepSpeed universal checkpoint (Megatron-DeepSpeed's "
        "flag): the folder DeepSpeed's ds_to_universal.py wrote, or the folder whose "
        "latest_universal names it; it loads at any tensor/pipeline/data-parallel size, with "
        "or without --deepspeed, optimizer state included.")
    exit_on_missing_checkpoint: bool = option(
        default=False, help="Stop with an error when --load holds no checkpoint.")
    no_verify_checkpoint: bool = option(
        default=False, help="Load without checksumming the files against the checkpoint's "
        "manifest.json (sizes are still checked): for checkpoints too large to read twice.")
    async_save: bool = option(
        default=False, help="Write checkpoints in the background: the state is copied to host "
        "memory, training goes on, and the checkpoint becomes the latest once every rank has "
        "written it (a save still running is finished before the run ends).")
    ckpt_format: str = option(
        "--ckpt-format", "--dist-ckpt-format", default="torch", choices=("torch", "torch_dist"),
        help="torch: Megatron's iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt files, one per "
        "(tensor, pipeline) rank. torch_dist: Megatron-LM's distributed format "
        "(torch.distributed.checkpoint, megatron-core's names): every rank writes its own "
        "shards, and it loads at any tensor/pipeline/data-parallel size. --load reads "
        "either, whatever this flag says.")

    def __post_init__(self) -> None:
        check_refused(self)
        one_of(self, "ckpt_format", ("torch", "torch_dist"))
        optional_positive(self, "save_interval", "keep_last_n_checkpoints")
        require(not self.universal_checkpoint or self.load is not None,
                "--universal-checkpoint needs --load (the universal checkpoint's folder, or the "
                "folder whose latest_universal names it)")
        require(not self.async_save or self.save is not None,
                "--async-save needs --save (the folder the checkpoints are written to)")

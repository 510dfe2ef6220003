"""What a load hands back (``LoadedCheckpoint``, ``LoadReport``) and the hints its errors
give; shared by the load driver (``load.py``) and every format's loader."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

from megatron.checkpointing.errors import CheckpointCorruptError
from megatron.checkpointing.folder import CheckpointFolder, list_iterations
from megatron.checkpointing.paths import TRACKER_FILENAME, reshard_hint


class _LoadedFields(NamedTuple):
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int


class LoadReport(NamedTuple):
    """What a load read and restored, for the run's log (which says what was reset)."""

    folder: str  # the iteration folder read
    iteration: int  # the checkpoint's iteration (a model-only load restarts at 0 anyway)
    release: bool
    optimizer: bool  # optimizer state restored
    scheduler: bool  # LR/weight-decay schedule restored
    rng: bool  # random generators restored
    # RNG state wanted but none for this layout (a converted checkpoint, or torch_dist saved
    # at another layout): the generators start from --seed
    rng_from_seed: bool = False


class LoadedCheckpoint(_LoadedFields):
    """``(iteration, consumed_train_samples, consumed_valid_samples)``; also ``.extra``: the
    checkpoint's other top-level entries (e.g. ``num_floating_point_operations_so_far``), and
    ``.report``: a LoadReport, None when nothing was loaded."""

    extra: dict
    report: Optional[LoadReport]

    def __new__(cls, iteration: int = 0, consumed_train_samples: int = 0,
                consumed_valid_samples: int = 0, extra: Optional[dict] = None,
                report: Optional[LoadReport] = None):
        self = super().__new__(cls, iteration, consumed_train_samples, consumed_valid_samples)
        self.extra = dict(extra or {})
        self.report = report
        return self


def with_hint(folder: CheckpointFolder, load_dir: str, check: Callable[[], None]) -> None:
    """``check()`` of ``folder``; a damaged or incomplete folder's error says which other
    checkpoints could be resumed instead."""
    try:
        check()
    except CheckpointCorruptError as error:
        hint = _earlier_checkpoints_hint(load_dir, folder.iteration)
        raise CheckpointCorruptError(f"{error}. {hint}") from error


def reshard_hint_for(config: Any) -> str:
    p = config.parallel
    return reshard_hint(config.checkpoint.load, p.tensor_model_parallel_size,
                        p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage)


def _earlier_checkpoints_hint(load_dir: str, damaged: Optional[int]) -> str:
    others = [it for it in list_iterations(load_dir) if it != damaged]
    if not others:
        return f"Restore the file from a copy (--load {load_dir} holds no other checkpoint)"
    return (f"Restore the file from a copy, or resume from another checkpoint of --load "
            f"{load_dir} ({', '.join(map(str, others[-5:]))}) by writing its iteration into "
            f"{os.path.join(load_dir, TRACKER_FILENAME)}")

"""Housekeeping of a --save folder: folders left by killed saves, --keep-last-n-checkpoints
pruning, and the --save-best record."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Sequence
from typing import Optional

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import write_text_atomic
from megatron.checkpointing.folder import (
    DEEPSPEED,
    MEGATRON,
    iteration_dir_name,
    list_iterations,
    read_tracker,
)
from megatron.checkpointing.paths import BEST_FILENAME, read_best

logger = logging.getLogger(__name__)

_LEFTOVER_RE = re.compile(rf"({MEGATRON.prefix}|{DEEPSPEED.prefix})\d+\.(tmp|old)-\w+")
# Temporary folders older than this process were left by a save that was killed (ours are
# created later); each save of rank 0 removes them.
_PROCESS_START = time.time()


def remove_leftover_folders(save_dir: str, older_than: Optional[float] = None) -> list[str]:
    """Delete ``iter_XXXXXXX.tmp-*`` / ``.old-*`` folders (DeepSpeed's ``global_stepN.tmp-*``
    too) of killed or failed saves that were last
    changed before ``older_than`` (default: this process's start). Returns their names."""
    older_than = _PROCESS_START if older_than is None else older_than
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if not _LEFTOVER_RE.fullmatch(name) or not os.path.isdir(path):
            continue
        try:
            if os.path.getmtime(path) >= older_than:
                continue  # possibly another run's save in progress
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
        logger.info("removed %s, left by an interrupted save", path)
    return removed


def prune_checkpoints(save_dir: str, keep_last: int, protect: Sequence[int] = ()) -> list[int]:
    """Delete ``iter_*`` folders older than the newest ``keep_last``, except ``protect``, the
    tracker's and the best one. Returns the deleted iterations."""
    keep = set(protect)
    tracker = read_tracker(save_dir)
    if tracker is not None and not tracker.release:
        keep.add(tracker.iteration)
    best = read_best(save_dir)
    if best is not None:
        keep.add(best.iteration)
    iterations = list_iterations(save_dir)
    keep.update(iterations[-keep_last:] if keep_last > 0 else [])
    deleted = [it for it in iterations if it not in keep]
    for it in deleted:
        shutil.rmtree(os.path.join(save_dir, iteration_dir_name(it)))
        logger.info("deleted old checkpoint %s (--keep-last-n-checkpoints %d)",
                    iteration_dir_name(it), keep_last)
    return deleted


def update_best_checkpoint(save_dir: str, iteration: int, valid_loss: float) -> bool:
    """Record ``iteration`` as the best checkpoint if ``valid_loss`` beats the recorded one.

    The best checkpoint's folder is exempt from ``--keep-last-n-checkpoints`` pruning. Writes
    from the calling process: in a distributed run call it on global rank 0 only
    (``save_checkpoint(..., valid_loss=...)`` does that). Returns whether it was recorded.
    """
    folder = os.path.join(save_dir, iteration_dir_name(iteration))
    if not os.path.isdir(folder):
        raise CheckpointError(f"cannot mark iteration {iteration} as the best checkpoint: "
                              f"{folder} does not exist")
    if not math.isfinite(valid_loss):
        return False
    best = read_best(save_dir)
    if best is not None and not valid_loss < best.valid_loss:
        return False
    write_text_atomic(os.path.join(save_dir, BEST_FILENAME), f"{iteration}\n{valid_loss!r}\n")
    return True

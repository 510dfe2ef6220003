"""The names of a checkpoint's files, and the checks of ``--save`` / ``--load`` that can be made
before anything is built. Which folder holds what, and which one is the latest: folder.py."""

from __future__ import annotations

import logging
import os
import re
import shlex
import tempfile
from typing import NamedTuple, Optional

from megatron.checkpointing.errors import CheckpointError

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
BEST_FILENAME = "best_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
MANIFEST_FILENAME = "manifest.json"

MP_RANK_RE = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


class BestCheckpoint(NamedTuple):
    iteration: int
    valid_loss: float


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def read_best(save_dir: str) -> Optional[BestCheckpoint]:
    """The checkpoint with the lowest validation loss so far (``--save-best``), if any."""
    path = os.path.join(save_dir, BEST_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        lines = f.read().split()
    try:
        return BestCheckpoint(int(lines[0]), float(lines[1]))
    except (IndexError, ValueError):
        raise CheckpointError(f"{path}: expected 'ITERATION VALID_LOSS', "
                              f"got {' '.join(lines)[:80]!r}") from None


def reshard_hint(load_dir: str, tp_size: int, pp_size: int,
                 vp_layers: Optional[int] = None) -> str:
    """How to get ``load_dir``'s checkpoint at this run's layout: the converter command with
    the real paths and sizes, ready to paste, and the ``--load`` to use after it."""
    new = f"{os.path.normpath(load_dir)}_tp{tp_size}_pp{pp_size}"
    cmd = ["python", "tools/checkpoint/convert.py", "--model-type", "GPT", "--loader",
           "megatron", "--saver", "megatron", "--load-dir", load_dir, "--save-dir", new,
           "--target-tensor-parallel-size", str(tp_size),
           "--target-pipeline-parallel-size", str(pp_size)]
    if vp_layers:
        cmd += ["--target-num-layers-per-virtual-pipeline-stage", str(vp_layers)]
    return f"reshard it with `{shlex.join(cmd)}`, then --load {shlex.quote(new)}"


# ---------------------------------------------------------------------------------------------
# --load and --save, checked before the model is built.


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_save_dir(save_dir: str) -> None:
    """``--save`` must be a folder this process can write in, or one it can create."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise CheckpointError(f"--save {save_dir} is a file, not a folder")
    existing = _nearest_existing(save_dir)
    if not os.path.isdir(existing):
        raise CheckpointError(f"--save {save_dir} cannot be created: {existing} is a file, "
                              "not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megatron-write-test-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        where = "" if existing == os.path.abspath(save_dir) else f" (in {existing})"
        raise CheckpointError(f"--save {save_dir} is not writable{where}: "
                              f"{error.strerror or error}") from None

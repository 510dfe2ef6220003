"""Where a checkpoint's files are: folder and file names, the tracker files, and the checks of
``--save`` / ``--load`` that can be made before anything is built."""

from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import tempfile
from typing import NamedTuple, Optional

from megatron.checkpointing.errors import CheckpointError, CheckpointLayoutError

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
BEST_FILENAME = "best_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
MANIFEST_FILENAME = "manifest.json"

ITER_RE = re.compile(r"iter_(\d{7,})")
MP_RANK_RE = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


class Tracker(NamedTuple):
    """What ``latest_checkpointed_iteration.txt`` says: an iteration, or a release folder."""

    iteration: int
    release: bool


class BestCheckpoint(NamedTuple):
    iteration: int
    valid_loss: float


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_path(save_dir: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    *, release: bool = False) -> str:
    """The ``model_optim_rng.pt`` of one (tensor, pipeline) rank."""
    return os.path.join(save_dir, iteration_dir_name(iteration, release),
                        mp_rank_dir_name(tp_rank, pp_rank, pp_size), MODEL_FILENAME)


def read_tracker(save_dir: str) -> Optional[Tracker]:
    """The tracker file of ``save_dir``; None when there is none (no checkpoint yet)."""
    path = os.path.join(save_dir, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return Tracker(0, True)
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number or 'release', "
                              f"got {text[:80]!r}") from None
    if iteration < 0:
        raise CheckpointError(f"{path}: negative iteration {iteration}")
    return Tracker(iteration, False)


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


def list_iterations(save_dir: str) -> list[int]:
    """Iterations that have a complete (renamed) checkpoint folder in ``save_dir``, sorted."""
    if not os.path.isdir(save_dir):
        return []
    found = (ITER_RE.fullmatch(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found
                  if m and os.path.isdir(os.path.join(save_dir, m.group(0))))


def resolve_iteration_dir(load_dir: str, tracker: Tracker) -> str:
    """The tracker's folder; or, after a crash in the middle of replacing a checkpoint of the
    same iteration, the older copy that was being replaced."""
    final = os.path.join(load_dir, iteration_dir_name(tracker.iteration, tracker.release))
    if os.path.isdir(final):
        return final
    backups = sorted(glob.glob(glob.escape(final) + ".old-*"), key=os.path.getmtime)
    if backups:
        logger.warning("%s is missing; loading %s (a save of the same iteration was "
                       "interrupted)", final, backups[-1])
        return backups[-1]
    raise CheckpointError(f"{os.path.join(load_dir, TRACKER_FILENAME)} names "
                          f"{os.path.basename(final)}, but {final} does not exist")


def saved_layout(iter_dir: str) -> tuple[int, int]:
    """(tensor, pipeline) sizes a checkpoint folder was saved with, from its mp_rank_* names."""
    found = [m for m in map(MP_RANK_RE.fullmatch, sorted(os.listdir(iter_dir))) if m]
    if not found:
        hint = ""
        if glob.glob(os.path.join(iter_dir, "*model_states.pt")):
            hint = " (it looks like a DeepSpeed checkpoint: load it with --deepspeed)"
        raise CheckpointError(f"{iter_dir} has no mp_rank_* folders{hint}")
    tp = 1 + max(int(m.group(1)) for m in found)
    pp = 1 + max(int(m.group(2)) if m.group(2) else 0 for m in found)
    return tp, pp


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


def check_layout(iter_dir: str, tp_size: int, pp_size: int, reshard: str,
                 saved: Optional[tuple[int, int]] = None) -> None:
    """Raise ``CheckpointLayoutError`` unless ``iter_dir`` was saved at (tp_size, pp_size).
    ``saved``: the layout its manifest records (else told from its mp_rank_* folders);
    ``reshard``: the ``reshard_hint`` to give."""
    saved = saved or saved_layout(iter_dir)
    now = (tp_size, pp_size)
    if saved != now:
        raise CheckpointLayoutError(
            f"checkpoint {iter_dir} was saved with tensor-model-parallel size {saved[0]} and "
            f"pipeline-model-parallel size {saved[1]} (tp={saved[0]}, pp={saved[1]}); this run "
            f"has tp={now[0]}, pp={now[1]}. Run with the saved layout, or {reshard}")


# ---------------------------------------------------------------------------------------------
# --load and --save, checked before the model is built.


def check_load_dir(load_dir: str, deepspeed: bool = False) -> None:
    """``--load`` must be the folder that holds the tracker file, or not exist yet (a first
    run with ``--save`` and ``--load`` the same folder starts from scratch). ``deepspeed``:
    the run trains with DeepSpeed's engine, which reads DeepSpeed's checkpoints."""
    if not os.path.exists(load_dir):
        return
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir} is a file, not a checkpoint folder: pass the "
                              f"folder that holds {TRACKER_FILENAME} (the --save of the run "
                              "that wrote it)")
    if os.path.isfile(os.path.join(load_dir, TRACKER_FILENAME)):
        return
    if os.path.isfile(os.path.join(load_dir, "latest")):  # DeepSpeed's tracker file
        if deepspeed:
            return
        raise CheckpointError(f"--load {load_dir} holds a DeepSpeed checkpoint (its 'latest' "
                              "file names the tag), which the built-in engine does not read: "
                              "add --deepspeed (with the --zero-stage and --deepspeed_config "
                              "it was saved with) to resume it")
    name = os.path.basename(os.path.normpath(load_dir))
    has_ranks = any(MP_RANK_RE.fullmatch(n) for n in os.listdir(load_dir))
    if has_ranks or ITER_RE.fullmatch(name) or name == "release":
        raise CheckpointError(f"--load {load_dir} is one iteration's folder, not a checkpoint "
                              f"folder: pass its parent, {os.path.dirname(load_dir) or '.'} "
                              f"(with {TRACKER_FILENAME} naming the iteration to load)")


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

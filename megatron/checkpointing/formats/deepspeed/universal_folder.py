"""DeepSpeed's universal checkpoint on disk (the folder ``ds_to_universal.py`` writes).

Megatron-DeepSpeed users reshard a DeepSpeed checkpoint by converting it::

    python deepspeed/checkpoint/ds_to_universal.py --input_folder SAVE/global_step100 \\
        --output_folder SAVE/global_step100_universal

which writes, whatever layout the run had::

    SAVE/latest_universal                       "global_step100_universal" (the output
                                                folder's name, written beside it)
    SAVE/global_step100_universal/
        mp_rank_XX_model_states.pt              the source's model-state files, copied: the
                                                engine's and the client state (iteration,
                                                consumed samples, LR schedule, run config)
        zero/optimizer_state.pt                 the optimizer's hyper-parameters
                                                (``param_groups``) and loss scaler
        zero/<parameter>/fp32.pt                {"param": the whole fp32 master weight,
                                                 "cat_dim": how its tensor-parallel pieces were
                                                 joined, ["vocab_tensor": True]}
        zero/<parameter>/exp_avg.pt, exp_avg_sq.pt   Adam's moments, same form
        zero/<parameter>/step.pt                the optimizer's step count

``<parameter>`` is the engine's parameter name (ours, our pipeline module's, or
Megatron-DeepSpeed's ``language_model.*`` / ``GPTModelPipe`` names). Vocabulary tensors are
stored without padding (``original_vocab_size`` rows). Nothing records the files a complete
folder holds: each file read is checked to exist and to unpickle, and an error names it.

This module finds such a folder (``find_universal``) and reads its files
(``UniversalFolder``); ``megatron/checkpointing/formats/deepspeed/universal.py`` maps the names to ours, reads it
into a full checkpoint and loads it into a run at any layout.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any, Optional

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import _legacy_safe_globals
from megatron.checkpointing.folder import namings_in

UNIVERSAL_TRACKER = "latest_universal"
ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # files of each parameter; step.pt besides
# ZeRO-3's model-state files are one per data-parallel rank (they hold no weights).
_MODEL_STATES_RE = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(\d{2})_model_states\.pt")
FLAG = "--universal-checkpoint"


def is_universal_folder(path: str) -> bool:
    """Whether ``path`` is a folder ``ds_to_universal.py`` wrote (``zero/`` beside the
    model-state files it copies)."""
    return (os.path.isdir(os.path.join(path, ZERO_DIR))
            and any(_MODEL_STATES_RE.fullmatch(n) for n in _listdir(path)))


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


@dataclasses.dataclass(frozen=True)
class UniversalFolder:
    """One universal checkpoint folder; ``load_dir``: the --load (or --load-dir) it was
    found from, for messages."""

    path: str
    load_dir: str

    @property
    def zero_dir(self) -> str:
        return os.path.join(self.path, ZERO_DIR)

    def model_state_files(self) -> list[str]:
        """The copied ``mp_rank_XX_model_states.pt`` files (ZeRO-3's
        ``zero_pp_rank_D_mp_rank_XX_model_states.pt``), the first model-parallel rank's
        first."""
        names = [n for n in _listdir(self.path) if _MODEL_STATES_RE.fullmatch(n)]
        names.sort(key=lambda n: (_MODEL_STATES_RE.fullmatch(n).group(1), len(n), n))
        return [os.path.join(self.path, n) for n in names]

    @property
    def from_zero3(self) -> bool:
        """Converted from a ZeRO-3 checkpoint: its model-state files are ZeRO-3's (one per
        data-parallel rank) and each parameter's tensors are stored flat."""
        return any(os.path.basename(f).startswith("zero_pp_rank_")
                   for f in self.model_state_files())

    @functools.cached_property
    def common(self) -> dict:
        """The first model-parallel rank's model-states file (memory-mapped): the client
        state (``iteration``, consumed samples, the schedule, the run's ``config`` or
        Megatron's ``args``) and ``universal_checkpoint_info``."""
        files = self.model_state_files()
        if not files:
            raise CheckpointError(f"{self.path} has no mp_rank_XX_model_states.pt: not a "
                                  "universal checkpoint (ds_to_universal.py copies them there)")
        return read_file(files[0], mmap=True)

    def param_dirs(self) -> list[str]:
        """The parameter names ``zero/`` holds a folder for (files are not checked here)."""
        names = [n for n in _listdir(self.zero_dir)
                 if os.path.isdir(os.path.join(self.zero_dir, n))]
        if not names:
            raise CheckpointError(f"{self.zero_dir} holds no parameter folders: "
                                  "ds_to_universal.py did not finish writing it")
        return names

    def file(self, param: str, key: str) -> str:
        return os.path.join(self.zero_dir, param, f"{key}.pt")

    def read_state(self, param: str, key: str, *, mmap: bool = False) -> dict:
        """``zero/<param>/<key>.pt`` (``key`` one of ``STATE_KEYS``): its dict, with the
        whole tensor under ``"param"`` (a ZeRO-3 conversion's file holds the tensor alone)."""
        path = self.file(param, key)
        state = read_file(path, mmap=mmap)
        if isinstance(state, torch.Tensor):
            state = {"param": state}
        if not isinstance(state, dict) or not isinstance(state.get("param"), torch.Tensor):
            raise CheckpointError(f"{path} holds no 'param' tensor: not a universal "
                                  "checkpoint's parameter file")
        return state

    def read_step(self, param: str) -> Optional[float]:
        """The optimizer's step of ``param`` (``step.pt``); None when there is none."""
        path = self.file(param, "step")
        if not os.path.exists(path):
            return None
        step = read_file(path)
        return float(step.item() if isinstance(step, torch.Tensor) else step)

    def optimizer_state(self, classes: list) -> dict:
        """``zero/optimizer_state.pt``: ``param_groups`` and the loss scaler (``classes``:
        DeepSpeed's, which it pickles)."""
        return read_file(os.path.join(self.zero_dir, OPTIMIZER_STATE_FILE), classes=classes)


def read_file(path: str, *, mmap: bool = False, classes: Optional[list] = None) -> Any:
    """One file of a universal folder, with an error naming it when it is missing or does
    not unpickle (truncated, corrupt). ``classes``: further classes it may hold."""
    if not os.path.isfile(path):
        raise CheckpointError(f"universal checkpoint file {path} does not exist")
    allowed = _legacy_safe_globals() + list(classes or [])
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - zipfile, pickle and torch errors all mean "bad"
        raise CheckpointError(f"cannot read universal checkpoint file {path} "
                              f"({os.path.getsize(path)} bytes): it is truncated, corrupt or "
                              f"not a torch file ({type(error).__name__}: "
                              f"{str(error)[:200]})") from None


def find_universal(load_dir: str, requested: bool, flag: str = "--load",
                   requested_by: str = FLAG) -> Optional[UniversalFolder]:
    """The universal checkpoint ``load_dir`` names: the folder itself when it is one; with
    ``requested`` (``--universal-checkpoint``), the folder its ``latest_universal`` names, as
    DeepSpeed's engine reads it. None when it names none; a ``CheckpointError`` when
    ``requested`` finds none, or when ``load_dir`` holds only a universal checkpoint and it
    was not requested (the run would otherwise start from scratch without a word).
    ``flag`` and ``requested_by`` name the folder's flag and the request in messages."""
    if is_universal_folder(load_dir):
        return UniversalFolder(os.path.normpath(load_dir), load_dir)
    tracker = os.path.join(load_dir, UNIVERSAL_TRACKER)
    if not os.path.isfile(tracker):
        if requested:
            what = "does not exist" if not os.path.exists(load_dir) else \
                f"holds no {UNIVERSAL_TRACKER} and is not a universal checkpoint folder"
            raise CheckpointError(f"{requested_by}: {flag} {load_dir} {what}: pass the folder "
                                  "DeepSpeed's ds_to_universal.py wrote (its --output_folder), "
                                  f"or the folder beside it that holds {UNIVERSAL_TRACKER}")
        return None
    with open(tracker) as f:
        tag = f.read().strip()
    path = os.path.join(load_dir, tag)
    if not requested:
        if _holds_other_checkpoints(load_dir):
            return None
        raise CheckpointError(f"{flag} {load_dir} holds only a universal checkpoint "
                              f"({UNIVERSAL_TRACKER} names {tag!r}): add {FLAG} to load it")
    if not tag or not is_universal_folder(path):
        raise CheckpointError(f"{tracker} names {tag!r}, but {path} is not a universal "
                              "checkpoint folder (no zero/ and mp_rank_XX_model_states.pt "
                              "there)")
    return UniversalFolder(path, load_dir)


def _holds_other_checkpoints(load_dir: str) -> bool:
    return bool(namings_in(load_dir))

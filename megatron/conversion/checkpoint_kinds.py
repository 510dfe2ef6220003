"""Which kind of checkpoint a folder holds, what it says about itself, and its whole model:
the one place that tells the kinds apart for the tools that take any checkpoint (generation
and its server, zero-shot evaluation, ``--use-checkpoint-args``).

Kinds, told by the folder's tracker file:

- ``megatron``: ``latest_checkpointed_iteration.txt`` naming ``iter_XXXXXXX/`` (or
  ``release/``) with ``mp_rank_TT[_PPP]/model_optim_rng.pt``: ours, and Megatron-LM's legacy
  and Megatron-DeepSpeed's (their ``language_model`` names, their flags as ``args``), at any
  tensor/pipeline/virtual layout; read by ``full.load_full_checkpoint``.
- ``deepspeed``: DeepSpeed's ``latest`` naming ``global_stepN/``: the plain engine at ZeRO 0-3
  and the pipeline engine (``layer_*-model_states.pt``), saved by our ``--deepspeed`` or by
  Megatron-DeepSpeed; read by ``deepspeed_layout.load_deepspeed_checkpoint``.

A folder holding both tracker files is read as ``megatron`` (as ``--load`` without
``--deepspeed`` reads it). Only the readers named above read files; this module picks one.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron.checkpointing.contents import stored_config
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import read_torch
from megatron.checkpointing.load import load_checkpoint_config
from megatron.checkpointing.manifest import read_manifest
from megatron.checkpointing.paths import (
    TRACKER_FILENAME,
    read_tracker,
    resolve_iteration_dir,
    saved_layout,
)
from megatron.conversion.deepspeed_layout import (
    LATEST_FILENAME,
    load_deepspeed_checkpoint,
    model_state_files,
    step_folder,
)
from megatron.conversion.full import (
    FullCheckpoint,
    config_from_stored,
    is_our_config,
    load_full_checkpoint,
)

MEGATRON = "megatron"
DEEPSPEED = "deepspeed"


def checkpoint_kind(load_dir: str) -> Optional[str]:
    """``MEGATRON``, ``DEEPSPEED``, or None when ``load_dir`` holds neither tracker file."""
    if os.path.isfile(os.path.join(load_dir, TRACKER_FILENAME)):
        return MEGATRON
    if os.path.isfile(os.path.join(load_dir, LATEST_FILENAME)):
        return DEEPSPEED
    return None


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """What a checkpoint folder's latest checkpoint says about itself, without its weights.

    ``stored``: the run configuration as saved: ours (``{"model": {...}, "parallel": ...}``)
    or Megatron's flat argparse fields; ``layout``: the (tensor, pipeline) sizes it was saved
    with; ``folder``: the iteration (``megatron``) or step (``deepspeed``) folder."""

    kind: str
    folder: str
    layout: tuple[int, int]
    stored: dict

    @property
    def ours(self) -> bool:
        return is_our_config(self.stored)

    def config(self) -> dict:
        """The run configuration as ours (model, data and parallel slices); Megatron's
        flags are mapped to our model and tokenizer fields, at tensor/pipeline size 1."""
        if self.ours:
            return dict(self.stored)
        return config_from_stored(self.stored, True, None, self.folder)


def missing_checkpoint_error(load_dir: str, flag: str = "--load") -> CheckpointError:
    return CheckpointError(f"{flag} {load_dir} holds no checkpoint (no {TRACKER_FILENAME}, "
                           f"nor DeepSpeed's '{LATEST_FILENAME}' file)")


def summarize_checkpoint(load_dir: str) -> Optional[CheckpointSummary]:
    """The summary of ``load_dir``'s latest checkpoint of either kind; None when the folder
    holds no checkpoint (or is no folder). A checkpoint that records no run configuration
    is a ``CheckpointError``."""
    kind = checkpoint_kind(load_dir) if os.path.isdir(load_dir) else None
    if kind == MEGATRON:
        return _megatron_summary(load_dir)
    if kind == DEEPSPEED:
        return _deepspeed_summary(load_dir)
    return None


def _megatron_summary(load_dir: str) -> CheckpointSummary:
    folder = resolve_iteration_dir(load_dir, read_tracker(load_dir))
    stored = load_checkpoint_config(load_dir)
    if not isinstance(stored, dict):
        raise CheckpointError(f"{folder} stores no run configuration (no 'config' or 'args')")
    return CheckpointSummary(MEGATRON, folder, saved_layout(folder), stored)


def _deepspeed_summary(load_dir: str) -> CheckpointSummary:
    """From the manifest our --deepspeed saves write, else from the first model-state file
    (memory-mapped: its weights are not read)."""
    folder = step_folder(load_dir)
    manifest = read_manifest(folder) or {}
    stored, layout = manifest.get("config"), manifest.get("parallel_layout") or {}
    if not isinstance(stored, dict):
        mp_files, zero3_files = model_state_files(folder)
        path = os.path.join(folder, (mp_files or zero3_files)[0])
        stored = stored_config(read_torch(path, mmap=True))
        if not isinstance(stored, dict):
            raise CheckpointError(f"{path} stores no run configuration (no 'config' or 'args')")
        layout = stored.get("parallel", stored)  # ours: the parallel slice; theirs: flat
    return CheckpointSummary(DEEPSPEED, folder, (
        int(layout.get("tensor_model_parallel_size") or 1),
        int(layout.get("pipeline_model_parallel_size") or 1)), stored)


def read_checkpoint(load_dir: str, *, verify: bool = True, optimizer: bool = True,
                    true_vocab_size: Optional[int] = None,
                    flag: str = "--load") -> FullCheckpoint:
    """The whole model (a ``FullCheckpoint``: tensor parallel 1, one stage) of ``load_dir``'s
    latest checkpoint of either kind, by that kind's one reader; ``verify``: check the files
    against the manifest first; ``optimizer=False``: the model only."""
    kind = checkpoint_kind(load_dir) if os.path.isdir(load_dir) else None
    if kind == MEGATRON:
        return load_full_checkpoint(load_dir, verify=verify, optimizer=optimizer,
                                    true_vocab_size=true_vocab_size)
    if kind == DEEPSPEED:
        return load_deepspeed_checkpoint(load_dir, true_vocab_size=true_vocab_size,
                                         verify=verify, optimizer=optimizer)
    raise missing_checkpoint_error(load_dir, flag)

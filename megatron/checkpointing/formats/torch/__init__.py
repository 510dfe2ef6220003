"""Megatron's torch format: one ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per (tensor,
pipeline) rank, and ``distrib_optim.pt`` beside it with the distributed optimizer (see
``checkpointing/__init__.py`` for what the files hold). ``save``: writing it, ``load``: each
rank reading its own files at the saved layout, ``whole``: reading every file into one
``FullCheckpoint``."""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

from megatron.checkpointing.contents import stored_config
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import read_torch
from megatron.checkpointing.folder import MEGATRON, CheckpointFolder
from megatron.checkpointing.format import LoadRequest, SaveRequest, register_format
from megatron.checkpointing.formats.torch import load, save, whole
from megatron.checkpointing.full_state import FullCheckpoint
from megatron.checkpointing.paths import MODEL_FILENAME, MP_RANK_RE, mp_rank_dir_name
from megatron.checkpointing.run_config import is_our_config


def _torch_layout(iter_dir: str) -> tuple[int, int]:
    found = [m for m in map(MP_RANK_RE.fullmatch, sorted(os.listdir(iter_dir))) if m]
    if not found:
        hint = ""
        if glob.glob(os.path.join(iter_dir, "*model_states.pt")):
            hint = " (it looks like a DeepSpeed checkpoint: load it with --deepspeed)"
        raise CheckpointError(f"{iter_dir} has no mp_rank_* folders{hint}")
    tp = 1 + max(int(m.group(1)) for m in found)
    pp = 1 + max(int(m.group(2)) if m.group(2) else 0 for m in found)
    return tp, pp


def _torch_common(iter_dir: str) -> dict:
    """Rank (0, 0)'s model_optim_rng.pt, memory-mapped: no tensor is read."""
    _, pp = _torch_layout(iter_dir)
    return read_torch(os.path.join(iter_dir, mp_rank_dir_name(0, 0, pp), MODEL_FILENAME),
                      mmap=True)


def _torch_config(iter_dir: str) -> Optional[dict]:
    return stored_config(_torch_common(iter_dir))


def _recognise_torch(iter_dir: str) -> bool:
    return any(MP_RANK_RE.fullmatch(n) and os.path.isdir(os.path.join(iter_dir, n))
               for n in os.listdir(iter_dir))


class TorchFormat:
    """``format.Format`` of Megatron's torch format (ours, Megatron-LM's and
    Megatron-DeepSpeed's ``--ckpt-format torch`` folders)."""

    name = "torch"
    naming = MEGATRON
    fallback = True

    def recognise(self, iter_dir: str) -> bool:
        return _recognise_torch(iter_dir)

    def layout(self, iter_dir: str) -> tuple[int, int]:
        return _torch_layout(iter_dir)

    def stored_config(self, iter_dir: str) -> Optional[dict]:
        return _torch_config(iter_dir)

    def common(self, iter_dir: str) -> dict:
        return _torch_common(iter_dir)

    def start_save(self, request: SaveRequest) -> save.TorchSaveJob:
        return save.start_save(request)

    def plan_save(self, request: SaveRequest, record: Any) -> None:
        save.take_state(request, record)

    def load(self, folder: CheckpointFolder, request: LoadRequest) -> Any:
        return load.load(folder, request)

    def read_whole(self, folder: CheckpointFolder, *, verify: bool,
                   true_vocab_size: Optional[int], optimizer: bool) -> FullCheckpoint:
        return whole.read_whole(folder, verify=verify, true_vocab_size=true_vocab_size,
                                optimizer=optimizer)

    def loads_at(self, folder: CheckpointFolder, parallel: Any) -> bool:
        """Ours, saved at these tensor, pipeline and virtual-pipeline sizes (and the same
        uneven first/last stages)."""
        p = parallel
        if not is_our_config(folder.config()) or folder.layout() != (
                p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
            return False
        saved = ((folder.manifest or {}).get("config") or {}).get("parallel") or {}
        return folder.num_model_chunks() == (p.virtual_pipeline_model_parallel_size or 1) and all(
            saved.get(k) == getattr(p, k) for k in ("decoder_first_pipeline_num_layers",
                                                    "decoder_last_pipeline_num_layers"))


TORCH = TorchFormat()
register_format(TORCH)

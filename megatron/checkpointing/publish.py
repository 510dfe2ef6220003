"""Publishing a checkpoint once every rank has written its files: global rank 0 writes the
manifest, renames the temporary folder into place, updates the tracker, the best checkpoint
and the retention (``PublishedSave``), or removes the temporary folder when the save failed.
Every format's save job is one; ``make_tmp_dir`` and ``host_copy`` serve them all."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import FileDigest
from megatron.checkpointing.folder import iteration_dir_name, make_tmp_folder, publish_checkpoint
from megatron.checkpointing.manifest import build_manifest
from megatron.checkpointing.ranks import RankLayout, broadcast_from_rank0
from megatron.checkpointing.retention import (
    prune_checkpoints,
    remove_leftover_folders,
    update_best_checkpoint,
)


@dataclasses.dataclass
class PublishedSave:
    """What every format's ``SaveJob`` shares: where the save goes and how global rank 0
    publishes it (manifest, rename, tracker, best, pruning) or abandons it."""

    iteration: int
    save_dir: str
    tmp_dir: str
    manifest_layout: dict
    config: dict
    checkpoint: Any  # the CheckpointConfig slice
    valid_loss: Optional[float]

    @property
    def folder(self) -> str:
        return os.path.join(self.save_dir, iteration_dir_name(self.iteration))

    def publish(self, digests: dict[str, FileDigest]) -> None:
        ckpt = self.checkpoint
        manifest = build_manifest(self.iteration, self.manifest_layout, self.config, digests)
        publish_checkpoint(self.save_dir, self.tmp_dir, self.iteration, manifest)
        remove_leftover_folders(self.save_dir)
        if ckpt.save_best and self.valid_loss is not None:
            update_best_checkpoint(self.save_dir, self.iteration, self.valid_loss)
        if ckpt.keep_last_n_checkpoints is not None:
            prune_checkpoints(self.save_dir, ckpt.keep_last_n_checkpoints,
                              protect=[self.iteration])

    def abandon(self) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def host_copy(obj: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``copy_tensor(tensor)`` (a host copy; dicts,
    lists and tuples rebuilt), so training may change the originals while it is written."""
    if isinstance(obj, torch.Tensor):
        return copy_tensor(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes (a state dict's _metadata)
        for k, v in obj.items():
            out[k] = host_copy(v, copy_tensor)
        return out
    if isinstance(obj, list):
        return [host_copy(v, copy_tensor) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(host_copy(v, copy_tensor) for v in obj)
    return obj


def make_tmp_dir(save_dir: str, iteration: int, layout: RankLayout) -> str:
    """A fresh folder for this save, created by global rank 0 and named to every rank."""
    tmp_dir, problem = None, None
    if layout.rank == 0:
        try:
            tmp_dir = make_tmp_folder(save_dir, iteration_dir_name(iteration))
        except OSError as error:  # the other ranks wait for the name: tell them instead
            problem = f"cannot create a folder in --save {save_dir}: {error}"
    tmp_dir, problem = broadcast_from_rank0((tmp_dir, problem))
    if problem is not None:
        raise CheckpointError(problem)
    return tmp_dir

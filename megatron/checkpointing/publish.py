"""Publishing a checkpoint once every rank has written its files: global rank 0 writes the
manifest, renames the temporary folder into place, updates the tracker, the best checkpoint
and the retention (``PublishedSave``), or removes the temporary folder when the save failed.
Every format's save job (torch in ``save.py``, torch_dist) is one."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Optional

from megatron.checkpointing.files import FileDigest
from megatron.checkpointing.folder import iteration_dir_name, publish_checkpoint
from megatron.checkpointing.manifest import build_manifest
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

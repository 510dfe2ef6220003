"""Loading a torch_dist folder (ours or Megatron-LM's) at any tensor, pipeline and
data-parallel size: every rank reads its own pieces of the global tensors."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from megatron.checkpointing.folder import CheckpointFolder
from megatron.checkpointing.format import LoadRequest
from megatron.checkpointing.formats.torch_dist import checkpoint as torch_dist
from megatron.checkpointing.loaded import LoadedCheckpoint, LoadReport, with_hint
from megatron.checkpointing.manifest import check_complete
from megatron.checkpointing.paths import MANIFEST_FILENAME
from megatron.checkpointing.ranks import RankLayout, raise_together

logger = logging.getLogger(__name__)


def load(folder: CheckpointFolder, r: LoadRequest) -> LoadedCheckpoint:
    """``load.load_checkpoint`` of a torch_dist folder (ours or Megatron-LM's), at any layout."""
    chunks, optimizer, scheduler, config, layout = (r.chunks, r.optimizer, r.scheduler,
                                                    r.config, r.layout)
    model_only, load_optim = r.model_only, r.load_optim
    ckpt = config.checkpoint
    iter_dir = folder.path
    error, common = None, None
    try:
        _verify_torch_dist(folder, layout, ckpt)
        common = torch_dist.read_common(iter_dir)
        torch_dist.check_stored_config(common, config, f"{iter_dir} (--load {ckpt.load})")
    except Exception as e:  # noqa: BLE001 - decide together before any collective
        error = e
    raise_together(error)
    logger.info("loading torch_dist checkpoint from %s at iteration %d", ckpt.load,
                folder.iteration)
    rng_wanted = not model_only and not ckpt.no_load_rng
    restored = torch_dist.read_into(iter_dir, common, chunks, optimizer, scheduler, config,
                                    layout, load_optim, rng_wanted)
    report = LoadReport(iter_dir, folder.iteration, folder.release, restored.optimizer,
                        restored.scheduler, restored.rng,
                        rng_from_seed=rng_wanted and not restored.rng)
    extra = torch_dist.extra_entries(common)
    if model_only:
        return LoadedCheckpoint(0, 0, 0, extra, report)
    return LoadedCheckpoint(*torch_dist.counters(common), extra=extra, report=report)


def _verify_torch_dist(folder: CheckpointFolder, layout: RankLayout, ckpt: Any) -> None:
    """Every rank checks every file's size against the manifest (each reads pieces of
    many); the checksums are shared out, each file read by one rank."""
    if folder.manifest is None:
        if layout.rank == 0:
            logger.warning("checkpoint %s has no %s (saved by Megatron-LM?): its files are not "
                           "verified", folder.path, MANIFEST_FILENAME)
        return
    names = sorted(folder.manifest["files"])
    world = dist.get_world_size() if dist.is_initialized() else 1

    def check() -> None:
        check_complete(folder.path, folder.manifest)
        folder.verify(names, checksums=False)
        if not ckpt.no_verify_checkpoint:
            folder.verify(names[layout.rank::world], checksums=True)

    with_hint(folder, ckpt.load, check)

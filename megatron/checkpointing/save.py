"""Saving: every rank writes into one temporary folder, global rank 0 adds the manifest and
renames the folder into place, and only then moves the tracker file."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, Optional

from megatron import xla
from megatron.checkpointing.contents import (
    ModelChunks,
    as_chunks,
    build_state,
    check_extra,
    config_dict,
    parallel_layout_dict,
)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import FileDigest, fsync_dir, write_text_atomic, write_torch
from megatron.checkpointing.manifest import build_manifest, write_manifest
from megatron.checkpointing.paths import (
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    iteration_dir_name,
)
from megatron.checkpointing.ranks import (
    RankLayout,
    all_true,
    broadcast_from_rank0,
    current_layout,
    gather_to_all,
)
from megatron.checkpointing.retention import (
    prune_checkpoints,
    remove_leftover_folders,
    update_best_checkpoint,
)
from megatron.checkpointing.rng import gather_rng_states
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.file_modes import chmod_as_created

logger = logging.getLogger(__name__)


def save_checkpoint(iteration: int, model_chunks: ModelChunks, optimizer: Any,
                    opt_param_scheduler: Any, config: Any, *, consumed_train_samples: int,
                    consumed_valid_samples: int = 0, extra: Optional[dict] = None,
                    valid_loss: Optional[float] = None) -> str:
    """Save a checkpoint of ``iteration`` to ``config.checkpoint.save``; returns its folder.

    Every rank must call it (it gathers RNG states, and the distributed optimizer's state,
    over data parallel). ``extra`` entries become top-level keys of every
    ``model_optim_rng.pt`` (plain values or tensors). With ``--save-best`` and a
    ``valid_loss``, the checkpoint is recorded as the best one if its loss is the lowest.
    Raises ``CheckpointError`` if any rank fails; the previous checkpoint stays the latest.
    """
    ckpt = config.checkpoint
    save_dir = ckpt.save
    if save_dir is None:
        raise CheckpointError("save_checkpoint needs --save")
    check_extra(extra)
    chunks = as_chunks(model_chunks)
    layout = current_layout()
    logger.info("saving checkpoint at iteration %7d to %s", iteration, save_dir)

    rng_states = None if ckpt.no_save_rng else gather_rng_states(layout)
    distrib_optim_state = None
    if isinstance(optimizer, DistributedOptimizer) and not ckpt.no_save_optim:
        distrib_optim_state = optimizer.state_dict()  # collective over data parallel
    tmp_dir = _make_tmp_dir(save_dir, iteration, layout)

    def state_fn() -> dict:
        # Saved from the host: XLA tensors become CPU ones, loadable without torch_xla.
        return xla.to_host(build_state(
            iteration, chunks, optimizer, opt_param_scheduler, config, layout, rng_states,
            (consumed_train_samples, consumed_valid_samples), extra))

    error, digests = None, {}
    try:
        digests = _write_rank_files(tmp_dir, layout, state_fn, distrib_optim_state)
    except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
        error = e
    if not all_true(error is None):
        if layout.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _raise_save_failure(error, layout, iteration, save_dir)

    all_digests = gather_to_all(digests)
    error = None
    if layout.rank == 0:
        try:
            manifest = build_manifest(iteration, parallel_layout_dict(layout, len(chunks)),
                                      config_dict(config), _merge(all_digests))
            _finish_on_rank0(save_dir, tmp_dir, iteration, config, valid_loss, manifest)
        except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
            error = e
    if not all_true(error is None):
        _raise_save_failure(error, layout, iteration, save_dir)
    logger.info("successfully saved checkpoint at iteration %7d to %s", iteration, save_dir)
    return os.path.join(save_dir, iteration_dir_name(iteration))


def _make_tmp_dir(save_dir: str, iteration: int, layout: RankLayout) -> str:
    """A fresh folder for this save, created by global rank 0 and named to every rank."""
    tmp_dir, problem = None, None
    if layout.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            tmp_dir = tempfile.mkdtemp(prefix=f"{iteration_dir_name(iteration)}.tmp-",
                                       dir=save_dir)
            chmod_as_created(tmp_dir)  # mkdtemp's 0700 would become iter_XXXXXXX's mode
        except OSError as error:  # the other ranks wait for the name: tell them instead
            problem = f"cannot create a folder in --save {save_dir}: {error}"
    tmp_dir, problem = broadcast_from_rank0((tmp_dir, problem))
    if problem is not None:
        raise CheckpointError(problem)
    return tmp_dir


def _write_rank_files(tmp_dir: str, layout: RankLayout, state_fn: Callable[[], dict],
                      distrib_optim_state: Optional[dict]) -> dict[str, FileDigest]:
    """Write this rank's files (data-parallel rank 0 of each (tensor, pipeline) rank writes);
    returns their digests by path relative to the iteration folder."""
    if layout.dp_rank != 0:
        return {}
    folder = os.path.join(tmp_dir, layout.mp_rank_dir)
    os.makedirs(folder, exist_ok=True)
    digests = {}
    digests[f"{layout.mp_rank_dir}/{MODEL_FILENAME}"] = write_torch(
        state_fn(), os.path.join(folder, MODEL_FILENAME))
    if distrib_optim_state is not None:
        digests[f"{layout.mp_rank_dir}/{DISTRIB_OPTIM_FILENAME}"] = write_torch(
            distrib_optim_state, os.path.join(folder, DISTRIB_OPTIM_FILENAME))
    return digests


def _merge(per_rank: list[dict[str, FileDigest]]) -> dict[str, FileDigest]:
    merged: dict[str, FileDigest] = {}
    for digests in per_rank:
        merged.update(digests)
    return merged


def publish_folder(save_dir: str, tmp_dir: str, name: str) -> Optional[str]:
    """Rename the finished folder ``tmp_dir`` into place as ``save_dir/name``; returns an
    older folder of that name's new name (to delete once the tracker is written), if there was
    one. Training's saves and the conversion tools publish alike."""
    final = os.path.join(save_dir, name)
    backup = None
    if os.path.lexists(final):
        backup = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, backup)
    os.rename(tmp_dir, final)
    fsync_dir(save_dir)
    return backup


def _finish_on_rank0(save_dir: str, tmp_dir: str, iteration: int, config: Any,
                     valid_loss: Optional[float], manifest: dict) -> None:
    ckpt = config.checkpoint
    try:
        write_manifest(tmp_dir, manifest)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    backup = publish_folder(save_dir, tmp_dir, iteration_dir_name(iteration))
    write_text_atomic(os.path.join(save_dir, TRACKER_FILENAME), str(iteration))
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    remove_leftover_folders(save_dir)
    if ckpt.save_best and valid_loss is not None:
        update_best_checkpoint(save_dir, iteration, valid_loss)
    if ckpt.keep_last_n_checkpoints is not None:
        prune_checkpoints(save_dir, ckpt.keep_last_n_checkpoints, protect=[iteration])


def _raise_save_failure(error: Optional[BaseException], layout: RankLayout, iteration: int,
                        save_dir: str) -> None:
    """Every rank, after a failed vote: its own error, or the lowest failing rank's, so that
    rank 0 (which speaks for all) names the real cause."""
    failures = gather_to_all(None if error is None else str(error))
    where = f"saving the checkpoint of iteration {iteration} to {save_dir} failed"
    after = "; the tracker file still names the previous checkpoint"
    if error is not None:
        raise CheckpointError(f"{where} on rank {layout.rank}: {error}{after}") from error
    rank, message = next((r, m) for r, m in enumerate(failures) if m is not None)
    raise CheckpointError(f"{where} on rank {rank}: {message}{after}")

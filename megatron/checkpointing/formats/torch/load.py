"""Loading Megatron's torch format: each rank reads its own ``mp_rank_TT[_PPP]`` files, which
must have been saved at this run's tensor, pipeline and virtual-pipeline sizes (another
layout is resharded by ``tools/checkpoint/convert.py``, or read whole by generation and
evaluation), after checking them against the manifest and the run's model shape."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

from torch import nn

from megatron.checkpointing.contents import (
    CONVERTED_KEY,
    MODEL_KEY_RE,
    ModelChunks,
    as_chunks,
    check_version,
    consumed_samples,
    extra_entries,
    model_keys,
    stored_config,
)
from megatron.checkpointing.errors import CheckpointError, CheckpointLayoutError
from megatron.checkpointing.files import read_torch
from megatron.checkpointing.folder import CheckpointFolder
from megatron.checkpointing.format import LoadRequest
from megatron.checkpointing.formats.torch.experts import localized, localized_optimizer
from megatron.checkpointing.loaded import (
    LoadedCheckpoint,
    LoadReport,
    reshard_hint_for,
    with_hint,
)
from megatron.checkpointing.manifest import check_complete, check_listed
from megatron.checkpointing.model_shape import check_model_shape
from megatron.checkpointing.paths import DISTRIB_OPTIM_FILENAME, MANIFEST_FILENAME, MODEL_FILENAME
from megatron.checkpointing.ranks import RankLayout, current_layout, raise_together
from megatron.checkpointing.rng import restore_rng_state, rng_state_for
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.optimizer import shards_state

logger = logging.getLogger(__name__)


def load(folder: CheckpointFolder, r: LoadRequest) -> LoadedCheckpoint:
    """``load.load_checkpoint`` of a torch-format folder saved at this run's layout."""
    return _load_rank_files(
        lambda: _read_rank_files(r.config, folder, r.layout, r.optimizer, r.load_optim),
        r.chunks, r.optimizer, r.scheduler, r.config, folder.path, folder.iteration,
        release=folder.release, strict=r.strict)


class _RankFiles(NamedTuple):
    """What this rank read: its model_optim_rng.pt (path and contents) and, when it loads a
    distributed optimizer, distrib_optim.pt's contents."""

    path: str
    state: dict
    distrib_state: Optional[dict]


def load_built_state(build: Callable[[], tuple[str, dict, Optional[dict]]],
                     model_chunks: ModelChunks, optimizer: Any, opt_param_scheduler: Any,
                     config: Any, folder: str, *, strict: bool = True) -> LoadedCheckpoint:
    """``load_checkpoint`` of a checkpoint whose file for this rank is built in memory from
    a format read whole (a DeepSpeed universal checkpoint, ``formats/deepspeed/universal.py``):
    ``build()`` returns ``(path for messages, model_optim_rng.pt's dict, distrib_optim.pt's
    or None)``. An error in any rank's ``build`` is raised on every rank. ``folder``: the
    checkpoint's, for the report. Every rank must call it."""
    def read() -> _RankFiles:
        return _RankFiles(*build())

    return _load_rank_files(read, as_chunks(model_chunks), optimizer, opt_param_scheduler,
                            config, folder, None, release=False, strict=strict)


def _load_rank_files(read: Callable[[], _RankFiles], chunks: list[nn.Module], optimizer: Any,
                     scheduler: Any, config: Any, folder: str, iteration: Optional[int], *,
                     release: bool, strict: bool) -> LoadedCheckpoint:
    """Read this rank's files (``read``), load the weights, then (once every rank has) the
    optimizer, scheduler and generators. ``iteration``: the folder's (None: the file's)."""
    ckpt = config.checkpoint
    model_only = ckpt.finetune or release
    load_optim = not model_only and not ckpt.no_load_optim
    error, files = None, None
    try:
        files = read()
        # Every expert is in the file: this rank keeps its own (expert parallelism).
        files = files._replace(state=localized(files.state, chunks),
                               distrib_state=localized_optimizer(files.distrib_state, chunks))
        _load_model(files.state, chunks, files.path, strict, reshard_hint_for(config))
    except Exception as e:  # noqa: BLE001 - decide together before any collective
        error = e
    raise_together(error)
    scheduler_loaded, rng_loaded = _restore_training_state(
        files, ckpt, current_layout(), optimizer, scheduler, model_only, load_optim)
    state = files.state
    rng_wanted = not model_only and not ckpt.no_load_rng
    if iteration is None:
        iteration = int(state["iteration"])
    report = LoadReport(folder, iteration, release, load_optim, scheduler_loaded, rng_loaded,
                        rng_from_seed=rng_wanted and not rng_loaded)
    if model_only:
        return LoadedCheckpoint(0, 0, 0, extra_entries(state), report)
    return LoadedCheckpoint(int(state["iteration"]), *consumed_samples(state),
                            extra=extra_entries(state), report=report)


def _read_rank_files(config: Any, folder: CheckpointFolder, layout: RankLayout, optimizer: Any,
                     load_optim: bool) -> _RankFiles:
    """Check the folder against this run and its manifest, then read this rank's files. The
    model shape is compared before any tensor is read when there is a manifest."""
    ckpt = config.checkpoint
    where = f"{folder.path} (--load {ckpt.load})"
    manifest = folder.manifest
    if manifest is not None:
        # Before the layout: a folder missing a rank's files is incomplete, not another
        # layout (the manifest records the one it was saved with).
        if os.path.isfile(folder.rank_file(layout.tp_rank, layout.pp_rank, layout.pp_size)):
            rel = f"{layout.mp_rank_dir}/{MODEL_FILENAME}"
            with_hint(folder, ckpt.load, lambda: check_listed(folder.path, manifest, rel))
        with_hint(folder, ckpt.load, lambda: check_complete(folder.path, manifest))
    _check_layout(folder, layout.tp_size, layout.pp_size, reshard_hint_for(config))
    if manifest is not None:
        check_model_shape(manifest.get("config"), config.model, where)
        _verify(folder, layout, load_optim, ckpt)
    elif layout.rank == 0:
        logger.warning("checkpoint %s has no %s (saved by an older version, or by Megatron-LM "
                       "/ Megatron-DeepSpeed): its files are not verified", folder.path,
                       MANIFEST_FILENAME)
    path = folder.rank_file(layout.tp_rank, layout.pp_rank, layout.pp_size)
    logger.info("loading checkpoint from %s at iteration %d", ckpt.load, folder.iteration)
    state = read_torch(path)
    check_version(state, path)
    if manifest is None:
        check_model_shape(stored_config(state), config.model, where)
    distrib_state = _read_distrib_optim(state, optimizer, path) if load_optim else None
    return _RankFiles(path, state, distrib_state)


def _check_layout(folder: CheckpointFolder, tp_size: int, pp_size: int, reshard: str) -> None:
    """Raise ``CheckpointLayoutError`` unless ``folder`` was saved at (tp_size, pp_size) (as
    its manifest records, else as its mp_rank_* folders tell); ``reshard``: the
    ``reshard_hint`` to give."""
    saved = folder.layout()
    now = (tp_size, pp_size)
    if saved != now:
        raise CheckpointLayoutError(
            f"checkpoint {folder.path} was saved with tensor-model-parallel size {saved[0]} and "
            f"pipeline-model-parallel size {saved[1]} (tp={saved[0]}, pp={saved[1]}); this run "
            f"has tp={now[0]}, pp={now[1]}. Run with the saved layout, or {reshard}")


def _verify(folder: CheckpointFolder, layout: RankLayout, load_optim: bool, ckpt: Any) -> None:
    """Check the files this rank reads against the manifest. Every rank checks sizes; the
    data-parallel rank 0 of each (tensor, pipeline) rank also checksums them, for its
    replicas read the same files (and a failure on any rank fails the load on all)."""
    model = f"{layout.mp_rank_dir}/{MODEL_FILENAME}"
    distrib = f"{layout.mp_rank_dir}/{DISTRIB_OPTIM_FILENAME}"
    rel_paths = [model] + ([distrib] if load_optim and distrib in folder.manifest["files"]
                           else [])
    checksums = layout.dp_rank == 0 and not ckpt.no_verify_checkpoint
    with_hint(folder, ckpt.load, lambda: folder.verify(rel_paths, checksums=checksums))


def _load_model(state: dict, chunks: list[nn.Module], path: str, strict: bool,
                reshard: str) -> None:
    keys = sorted((k for k in state if MODEL_KEY_RE.fullmatch(k)),
                  key=lambda k: int(k[5:] or 0))
    if keys != model_keys(len(chunks)):
        raise CheckpointLayoutError(
            f"{path} holds {len(keys)} model chunk(s) ({', '.join(keys) or 'none'}), this run "
            f"has {len(chunks)} (virtual pipeline size): run with the saved "
            f"--num-layers-per-virtual-pipeline-stage, or {reshard}")
    for key, chunk in zip(keys, chunks):
        try:
            unwrap_model(chunk).load_state_dict(state[key], strict=strict)
        except RuntimeError as error:
            raise CheckpointError(f"{path}: '{key}' does not fit this model: {error}") from error


def _read_distrib_optim(state: dict, optimizer: Any, path: str) -> Optional[dict]:
    """The distributed optimizer's saved state, after checking the optimizer kinds match."""
    saved_distributed = bool(state.get("distributed_optimizer"))
    running_distributed = shards_state(optimizer)
    if saved_distributed != running_distributed:
        how = "with" if saved_distributed else "without"
        raise CheckpointError(
            f"{path} was saved {how} --use-distributed-optimizer and this run "
            f"{'uses' if running_distributed else 'does not use'} it: match the flag, or pass "
            "--no-load-optim to load the weights only")
    if not saved_distributed:
        return None
    # Every data-parallel rank reads the file but copies out only its own shard.
    return read_torch(os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILENAME), mmap=True)


def _restore_training_state(files: _RankFiles, ckpt: Any, layout: RankLayout, optimizer: Any,
                            scheduler: Any, model_only: bool,
                            load_optim: bool) -> tuple[bool, bool]:
    """Optimizer, scheduler and generators, after every rank has loaded its weights; returns
    whether the scheduler's state and the generators' state were restored (a converted
    checkpoint holds no generator state)."""
    scheduler_loaded = False
    if load_optim:
        scheduler_loaded = _load_optimizer(files, optimizer,
                                           None if ckpt.no_load_lr_state else scheduler)
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main copies must follow the loaded weights
    if not model_only and not ckpt.no_load_rng:
        rng = rng_state_for(files.state, layout, files.path)
        if rng is None and CONVERTED_KEY in files.state:
            logger.info("%s was converted to this layout and holds no random-generator state: "
                        "the generators start from --seed", files.path)
            return scheduler_loaded, False
        if rng is None:
            raise CheckpointError(f"{files.path} has no RNG state (saved with --no-save-rng?): "
                                  "pass --no-load-rng")
        restore_rng_state(rng)
        return scheduler_loaded, True
    return scheduler_loaded, False


def _load_optimizer(files: _RankFiles, optimizer: Any, scheduler: Any) -> bool:
    """Restore the optimizer (and the scheduler, if given); returns whether the scheduler's
    state was restored (a checkpoint may hold none)."""
    state, path = files.state, files.path
    if optimizer is not None:
        if files.distrib_state is not None:
            optimizer.load_state_dict(files.distrib_state)  # collective over data parallel
        elif "optimizer" in state:
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (KeyError, ValueError) as error:
                raise CheckpointError(f"{path}: the optimizer state does not fit this "
                                      f"optimizer: {error}") from error
        else:
            raise CheckpointError(f"{path} has no optimizer state (saved with "
                                  "--no-save-optim?): pass --no-load-optim or --finetune")
    saved = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    if scheduler is not None and saved is not None:
        scheduler.load_state_dict(saved)
        return True
    return False

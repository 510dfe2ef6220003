"""Loading: find the tracker's folder, check it fits this run (layout, model shape) and is
intact (the manifest), then copy weights, optimizer, scheduler and generators in."""

from __future__ import annotations

import logging
import os
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
from megatron.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLayoutError,
)
from megatron.checkpointing.files import read_torch
from megatron.checkpointing.manifest import (
    check_complete,
    check_listed,
    manifest_layout,
    read_manifest,
    verify_files,
)
from megatron.checkpointing.model_shape import check_model_shape
from megatron.checkpointing.paths import (
    DISTRIB_OPTIM_FILENAME,
    MANIFEST_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    Tracker,
    check_layout,
    check_load_dir,
    list_iterations,
    mp_rank_dir_name,
    read_tracker,
    reshard_hint,
    resolve_iteration_dir,
    saved_layout,
)
from megatron.checkpointing.ranks import (
    RankLayout,
    all_true,
    check_same_everywhere,
    current_layout,
    gather_to_all,
)
from megatron.checkpointing.rng import restore_rng_state, rng_state_for
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

logger = logging.getLogger(__name__)


class _LoadedFields(NamedTuple):
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int


class LoadReport(NamedTuple):
    """What a load read and restored, for the run's log (which says what was reset)."""

    folder: str  # the iteration folder read
    iteration: int  # the checkpoint's iteration (a model-only load restarts at 0 anyway)
    release: bool
    optimizer: bool  # optimizer state restored
    scheduler: bool  # LR/weight-decay schedule restored
    rng: bool  # random generators restored
    # a converted checkpoint without RNG state: the generators start from --seed
    rng_from_seed: bool = False


class LoadedCheckpoint(_LoadedFields):
    """``(iteration, consumed_train_samples, consumed_valid_samples)``; also ``.extra``: the
    checkpoint's other top-level entries (e.g. ``num_floating_point_operations_so_far``), and
    ``.report``: a LoadReport, None when nothing was loaded."""

    extra: dict
    report: Optional[LoadReport]

    def __new__(cls, iteration: int = 0, consumed_train_samples: int = 0,
                consumed_valid_samples: int = 0, extra: Optional[dict] = None,
                report: Optional[LoadReport] = None):
        self = super().__new__(cls, iteration, consumed_train_samples, consumed_valid_samples)
        self.extra = dict(extra or {})
        self.report = report
        return self


class _RankFiles(NamedTuple):
    """What this rank read: its model_optim_rng.pt (path and contents) and, when it loads a
    distributed optimizer, distrib_optim.pt's contents."""

    path: str
    state: dict
    distrib_state: Optional[dict]


def load_checkpoint(model_chunks: ModelChunks, optimizer: Any, opt_param_scheduler: Any,
                    config: Any, *, strict: bool = True) -> LoadedCheckpoint:
    """Load the latest checkpoint of ``config.checkpoint.load`` into this rank's model.

    Returns ``(iteration, consumed_train_samples, consumed_valid_samples)`` (and ``.extra``):
    zeros when there is no ``--load`` or no tracker file in it. ``--finetune`` and release
    checkpoints load the weights only and restart at iteration 0; ``--no-load-optim`` skips
    the optimizer and scheduler, ``--no-load-rng`` the generators. The files read are checked
    against the checkpoint's manifest first (``--no-verify-checkpoint``: sizes only), and the
    model flags against the config stored with it. Every rank must call it.
    """
    ckpt = config.checkpoint
    if ckpt.load is None:
        return LoadedCheckpoint()
    check_load_dir(ckpt.load)
    tracker = read_tracker(ckpt.load)
    check_same_everywhere(-1 if tracker is None else tracker.iteration, "the latest iteration")
    if tracker is None:
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint in --load "
                                  f"{ckpt.load} (no {TRACKER_FILENAME} there)")
        logger.warning("no %s in %s: starting from scratch", TRACKER_FILENAME, ckpt.load)
        return LoadedCheckpoint()

    chunks = as_chunks(model_chunks)
    layout = current_layout()
    model_only = ckpt.finetune or tracker.release
    load_optim = not model_only and not ckpt.no_load_optim
    error, files = None, None
    try:
        files = _read_rank_files(config, tracker, layout, optimizer, load_optim)
        _load_model(files.state, chunks, files.path, strict, _reshard_hint(config))
    except Exception as e:  # noqa: BLE001 - decide together before any collective
        error = e
    if not all_true(error is None):
        _raise_first_failure(error)
    scheduler_loaded, rng_loaded = _restore_training_state(
        files, ckpt, layout, optimizer, opt_param_scheduler, model_only, load_optim)
    state = files.state
    rng_wanted = not model_only and not ckpt.no_load_rng
    report = LoadReport(os.path.dirname(os.path.dirname(files.path)), tracker.iteration,
                        tracker.release, load_optim, scheduler_loaded, rng_loaded,
                        rng_from_seed=rng_wanted and not rng_loaded)
    if model_only:
        return LoadedCheckpoint(0, 0, 0, extra_entries(state), report)
    return LoadedCheckpoint(int(state["iteration"]), *consumed_samples(state),
                            extra=extra_entries(state), report=report)


def _raise_first_failure(error: Optional[Exception]) -> None:
    """After a failed vote: this rank's own error, or the lowest failing rank's message, so
    that rank 0 (which speaks for all) names the real cause."""
    if error is not None:
        gather_to_all(str(error))
        raise error
    failures = gather_to_all(None)
    rank, message = next((r, m) for r, m in enumerate(failures) if m is not None)
    raise CheckpointError(f"on rank {rank}: {message}")


def _read_rank_files(config: Any, tracker: Tracker, layout: RankLayout, optimizer: Any,
                     load_optim: bool) -> _RankFiles:
    """Check the tracker's folder against this run and its manifest, then read this rank's
    files. The model shape is compared before any tensor is read when there is a manifest."""
    ckpt = config.checkpoint
    iter_dir = resolve_iteration_dir(ckpt.load, tracker)
    where = f"{iter_dir} (--load {ckpt.load})"
    manifest = read_manifest(iter_dir)
    model_rel = f"{layout.mp_rank_dir}/{MODEL_FILENAME}"
    if manifest is not None:
        if os.path.isfile(os.path.join(iter_dir, layout.mp_rank_dir, MODEL_FILENAME)):
            _with_hint(check_listed, ckpt.load, iter_dir, manifest, model_rel)
        _with_hint(check_complete, ckpt.load, iter_dir, manifest)
    check_layout(iter_dir, layout.tp_size, layout.pp_size, _reshard_hint(config),
                 manifest_layout(manifest) if manifest is not None else None)
    if manifest is not None:
        check_model_shape(manifest.get("config"), config.model, where)
        _verify(iter_dir, manifest, layout, load_optim, ckpt)
    elif layout.rank == 0:
        logger.warning("checkpoint %s has no %s (saved by an older version, or by Megatron-LM "
                       "/ Megatron-DeepSpeed): its files are not verified", iter_dir,
                       MANIFEST_FILENAME)
    path = os.path.join(iter_dir, layout.mp_rank_dir, MODEL_FILENAME)
    logger.info("loading checkpoint from %s at iteration %d", ckpt.load, tracker.iteration)
    state = read_torch(path)
    check_version(state, path)
    if manifest is None:
        check_model_shape(stored_config(state), config.model, where)
    distrib_state = _read_distrib_optim(state, optimizer, path) if load_optim else None
    return _RankFiles(path, state, distrib_state)


def _verify(iter_dir: str, manifest: dict, layout: RankLayout, load_optim: bool,
            ckpt: Any) -> None:
    """Check the files this rank reads against the manifest. Every rank checks sizes; the
    data-parallel rank 0 of each (tensor, pipeline) rank also checksums them, for its
    replicas read the same files (and a failure on any rank fails the load on all)."""
    model = f"{layout.mp_rank_dir}/{MODEL_FILENAME}"
    distrib = f"{layout.mp_rank_dir}/{DISTRIB_OPTIM_FILENAME}"
    rel_paths = [model] + ([distrib] if load_optim and distrib in manifest["files"] else [])
    checksums = layout.dp_rank == 0 and not ckpt.no_verify_checkpoint
    _with_hint(verify_files, ckpt.load, iter_dir, manifest, rel_paths, checksums=checksums)


def _with_hint(check: Any, load_dir: str, iter_dir: str, manifest: dict, *args: Any,
               **kwargs: Any) -> None:
    """``check(iter_dir, manifest, ...)``; a damaged or incomplete folder's error says which
    other checkpoints could be resumed instead."""
    try:
        check(iter_dir, manifest, *args, **kwargs)
    except CheckpointCorruptError as error:
        hint = _earlier_checkpoints_hint(load_dir, manifest.get("iteration"))
        raise CheckpointCorruptError(f"{error}. {hint}") from error


def _reshard_hint(config: Any) -> str:
    p = config.parallel
    return reshard_hint(config.checkpoint.load, p.tensor_model_parallel_size,
                        p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage)


def _earlier_checkpoints_hint(load_dir: str, damaged: Optional[int]) -> str:
    others = [it for it in list_iterations(load_dir) if it != damaged]
    if not others:
        return f"Restore the file from a copy (--load {load_dir} holds no other checkpoint)"
    return (f"Restore the file from a copy, or resume from another checkpoint of --load "
            f"{load_dir} ({', '.join(map(str, others[-5:]))}) by writing its iteration into "
            f"{os.path.join(load_dir, TRACKER_FILENAME)}")


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
    running_distributed = isinstance(optimizer, DistributedOptimizer)
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


def load_scheduler_state(load_dir: str) -> Optional[tuple[str, dict]]:
    """The learning-rate schedule stored with the latest checkpoint of ``load_dir``: its
    folder and state, or None when there is none to resume (no checkpoint, a release one, a
    file that cannot be read: loading reports those). Reads one small entry of a
    memory-mapped file, so it is cheap enough to check before anything is built."""
    try:
        tracker = read_tracker(load_dir)
        if tracker is None or tracker.release:
            return None
        iter_dir = resolve_iteration_dir(load_dir, tracker)
        _, pp = saved_layout(iter_dir)
        state = read_torch(os.path.join(iter_dir, mp_rank_dir_name(0, 0, pp), MODEL_FILENAME),
                           mmap=True)
    except (CheckpointError, OSError):
        return None
    saved = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    return (iter_dir, saved) if isinstance(saved, dict) else None


def load_checkpoint_config(load_dir: str) -> Optional[dict]:
    """The run configuration stored with the latest checkpoint of ``load_dir`` (plain dicts;
    Megatron's checkpoints: their argparse fields), or None if there is no checkpoint or it
    stores none (for ``--use-checkpoint-args``). Read from the manifest when there is one."""
    tracker = read_tracker(load_dir)
    if tracker is None:
        return None
    iter_dir = resolve_iteration_dir(load_dir, tracker)
    manifest = read_manifest(iter_dir)
    if manifest is not None and manifest.get("config") is not None:
        return manifest["config"]
    _, pp = saved_layout(iter_dir)
    return stored_config(read_torch(os.path.join(iter_dir, mp_rank_dir_name(0, 0, pp),
                                                 MODEL_FILENAME)))


"""Loading: find the tracker's folder, check it fits this run (layout, model shape) and is
intact (the manifest), then copy weights, optimizer, scheduler and generators in."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch.distributed as dist
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
from megatron.checkpointing.folder import (
    MEGATRON,
    CheckpointFolder,
    Naming,
    check_load_dir,
    find_checkpoint,
    latest_checkpoint,
    list_iterations,
)
from megatron.checkpointing.manifest import check_complete, check_listed
from megatron.checkpointing.model_shape import check_model_shape, saved_model_fields
from megatron.checkpointing.paths import (
    DISTRIB_OPTIM_FILENAME,
    MANIFEST_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    reshard_hint,
)
from megatron.checkpointing.ranks import (
    RankLayout,
    check_same_everywhere,
    current_layout,
    raise_together,
)
from megatron.checkpointing.rng import restore_rng_state, rng_state_for
from megatron.config import ConfigError
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.optimizer import shards_state

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
    # RNG state wanted but none for this layout (a converted checkpoint, or torch_dist saved
    # at another layout): the generators start from --seed
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
    folder = _agreed_latest(ckpt.load)
    if folder is None:
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint in --load "
                                  f"{ckpt.load} (no {TRACKER_FILENAME} there)")
        logger.warning("no checkpoint in %s (no %s there): starting from scratch", ckpt.load,
                       TRACKER_FILENAME)
        return LoadedCheckpoint()

    chunks = as_chunks(model_chunks)
    layout = current_layout()
    model_only = ckpt.finetune or folder.release
    load_optim = not model_only and not ckpt.no_load_optim
    if folder.format.name == "torch_dist":
        return _load_torch_dist(folder, chunks, optimizer, opt_param_scheduler, config, layout,
                                model_only, load_optim)
    return _load_rank_files(
        lambda: _read_rank_files(config, folder, layout, optimizer, load_optim),
        chunks, optimizer, opt_param_scheduler, config, folder.path, folder.iteration,
        release=folder.release, strict=strict)


def load_built_state(build: Callable[[], tuple[str, dict, Optional[dict]]],
                     model_chunks: ModelChunks, optimizer: Any, opt_param_scheduler: Any,
                     config: Any, folder: str, *, strict: bool = True) -> LoadedCheckpoint:
    """``load_checkpoint`` of a checkpoint whose file for this rank is built in memory from
    a format read whole (a DeepSpeed universal checkpoint, ``conversion/universal.py``):
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
        _load_model(files.state, chunks, files.path, strict, _reshard_hint(config))
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


def _agreed_latest(load_dir: str) -> Optional[CheckpointFolder]:
    """``latest_checkpoint(load_dir)``, the same on every rank (an error on any is raised on
    all, so none waits for the others in a collective)."""
    error, folder = None, None
    try:
        folder = latest_checkpoint(load_dir)
    except CheckpointError as e:
        error = e
    raise_together(error)
    check_same_everywhere(-1 if folder is None else folder.iteration, "the latest iteration")
    return folder


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
            _with_hint(folder, ckpt.load, lambda: check_listed(folder.path, manifest, rel))
        _with_hint(folder, ckpt.load, lambda: check_complete(folder.path, manifest))
    _check_layout(folder, layout.tp_size, layout.pp_size, _reshard_hint(config))
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
    _with_hint(folder, ckpt.load, lambda: folder.verify(rel_paths, checksums=checksums))


def _with_hint(folder: CheckpointFolder, load_dir: str, check: Callable[[], None]) -> None:
    """``check()`` of ``folder``; a damaged or incomplete folder's error says which other
    checkpoints could be resumed instead."""
    try:
        check()
    except CheckpointCorruptError as error:
        hint = _earlier_checkpoints_hint(load_dir, folder.iteration)
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


def _load_torch_dist(folder: CheckpointFolder, chunks: list[nn.Module], optimizer: Any,
                     scheduler: Any, config: Any, layout: RankLayout, model_only: bool,
                     load_optim: bool) -> LoadedCheckpoint:
    """``load_checkpoint`` of a torch_dist folder (ours or Megatron-LM's), at any layout."""
    from megatron.checkpointing import torch_dist

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

    _with_hint(folder, ckpt.load, check)


def load_scheduler_state(load_dir: str, naming: Naming = MEGATRON,
                         universal: bool = False) -> Optional[tuple[str, dict]]:
    """The learning-rate schedule stored with the latest checkpoint of ``load_dir`` (``naming``
    DEEPSPEED: the one our DeepSpeed engine stores in its client state; ``universal``
    (--universal-checkpoint), or ``load_dir`` a universal checkpoint: the one copied into
    it): its folder and state, or None when there is none to resume (no checkpoint, a
    release one, a format or file that cannot be read ahead: loading reports those). Reads
    one small entry of a memory-mapped file, so it is cheap enough to check before anything
    is built."""
    from megatron.checkpointing.universal import find_universal

    try:
        found = find_universal(load_dir, universal)
        if found is not None:
            path, state = found.path, found.common
        else:
            folder = latest_checkpoint(load_dir, naming, warn=False)  # the load warns
            if folder is None or folder.release:
                return None
            path, state = folder.path, folder.format.common(folder.path)
    except (CheckpointError, OSError):
        return None
    saved = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    return (path, saved) if isinstance(saved, dict) else None


def load_checkpoint_config(load_dir: str) -> Optional[dict]:
    """The run configuration stored with the latest checkpoint of ``load_dir`` (plain dicts;
    Megatron's checkpoints: their argparse fields), or None if there is no checkpoint or it
    stores none (for ``--use-checkpoint-args``). Read from the manifest when there is one."""
    folder = latest_checkpoint(load_dir)
    return None if folder is None else folder.config()


# What --use-checkpoint-args takes from the checkpoint: the model's shape (as Megatron's
# load_args_from_checkpoint does); the parallel layout and the run stay the user's.
CHECKPOINT_MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
    "layernorm_epsilon", "untie_embeddings_and_output_weights", "position_embedding_type",
    "rotary_percent", "rotary_base", "add_bias_linear", "activation", "normalization",
    "swiglu", "group_query_attention", "num_query_groups", "add_qkv_bias",
    "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
)


def checkpoint_model_settings(load_dir: str) -> dict[str, Any]:
    """The model-shape values stored in the latest checkpoint of ``load_dir`` (any kind:
    ours, Megatron's, DeepSpeed's), for ``parse_args(checkpoint_settings=...)``; a
    ``ConfigError`` naming --use-checkpoint-args when there is none to read."""
    try:
        folder = find_checkpoint(load_dir)
        stored = None if folder is None else folder.config()
    except (CheckpointError, OSError) as error:
        raise ConfigError(f"--use-checkpoint-args: cannot read --load {load_dir}: "
                          f"{error}") from None
    if folder is None:
        raise ConfigError(f"--use-checkpoint-args: --load {load_dir} holds no checkpoint")
    if not isinstance(stored, dict):
        raise ConfigError(f"--use-checkpoint-args: {folder.path} stores no run configuration "
                          "(no 'config' or 'args')")
    model = saved_model_fields(stored)  # ours: nested slices; Megatron's: flat args
    return {k: model[k] for k in CHECKPOINT_MODEL_FIELDS if model.get(k) is not None}

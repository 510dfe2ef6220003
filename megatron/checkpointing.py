"""Save and load training checkpoints in Megatron's layout, atomically.

On disk (as Megatron-LM / Megatron-DeepSpeed)::

    SAVE/latest_checkpointed_iteration.txt     "100" (or "release": the folder release/)
    SAVE/iter_0000100/mp_rank_{tp:02d}/model_optim_rng.pt              pipeline size 1
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt     pipeline size > 1
    SAVE/iter_0000100/mp_rank_.../distrib_optim.pt   with --use-distributed-optimizer
    SAVE/best_checkpointed_iteration.txt       with --save-best: iteration and its valid loss

``model_optim_rng.pt`` is written by data-parallel rank 0 of each (tensor, pipeline) rank and
holds ``checkpoint_version`` (3.0), ``iteration``, ``config`` (the resolved RunConfig as plain
dicts), ``parallel_layout``, ``consumed_train_samples``/``consumed_valid_samples``, ``model``
(``model0``, ``model1``, ... for virtual-pipeline chunks), ``optimizer``,
``opt_param_scheduler``, ``rng_state`` (one entry per data-parallel rank: python, numpy, torch
CPU/CUDA generators and the tensor-parallel tracker) and whatever the caller passed as
``extra`` (e.g. ``num_floating_point_operations_so_far``) as further top-level keys.
The distributed optimizer's state is gathered over data parallel into ``distrib_optim.pt``
(full, unsharded tensors keyed by parameter name), so it loads at any data-parallel size.

A save writes everything into ``SAVE/iter_XXXXXXX.tmp-<unique>``; when every rank has
succeeded, global rank 0 renames that folder to ``iter_XXXXXXX`` and only then replaces the
tracker file. A crash at any point leaves the previous checkpoint the one the tracker names;
the next save removes the temporary folder such a crash left behind.
Files are read with ``torch.load(weights_only=True)``: everything stored is tensors and plain
Python values.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.file_modes import chmod_as_created

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
BEST_FILENAME = "best_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
RESHARD_HINT = ("convert it with tools/checkpoint_util.py (--target-tensor-parallel-size, "
                "--target-pipeline-parallel-size)")

_ITER_RE = re.compile(r"iter_(\d{7,})")
_MP_RANK_RE = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_MODEL_KEY_RE = re.compile(r"model\d*")
# Top-level keys this module reads itself; anything else in a file is the caller's ``extra``.
_RESERVED_KEYS = frozenset({
    "checkpoint_version", "iteration", "config", "args", "parallel_layout",
    "consumed_train_samples", "consumed_valid_samples", "optimizer", "distributed_optimizer",
    "opt_param_scheduler", "lr_scheduler", "rng_state", "random_rng_state", "np_rng_state",
    "torch_rng_state", "cuda_rng_state", "rng_tracker_states", "tokens",
})

ModelChunks = Union[nn.Module, Sequence[nn.Module]]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit this run."""


class CheckpointLayoutError(CheckpointError):
    """The checkpoint was saved with another tensor/pipeline/virtual-pipeline layout."""


class Tracker(NamedTuple):
    """What ``latest_checkpointed_iteration.txt`` says: an iteration, or a release folder."""

    iteration: int
    release: bool


class BestCheckpoint(NamedTuple):
    iteration: int
    valid_loss: float


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


# ---------------------------------------------------------------------------------------------
# Names and the tracker file.


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_path(save_dir: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    *, release: bool = False) -> str:
    """The ``model_optim_rng.pt`` of one (tensor, pipeline) rank."""
    return os.path.join(save_dir, iteration_dir_name(iteration, release),
                        mp_rank_dir_name(tp_rank, pp_rank, pp_size), MODEL_FILENAME)


def read_tracker(save_dir: str) -> Optional[Tracker]:
    """The tracker file of ``save_dir``; None when there is none (no checkpoint yet)."""
    path = os.path.join(save_dir, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return Tracker(0, True)
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number or 'release', "
                              f"got {text[:80]!r}") from None
    if iteration < 0:
        raise CheckpointError(f"{path}: negative iteration {iteration}")
    return Tracker(iteration, False)


def read_best(save_dir: str) -> Optional[BestCheckpoint]:
    """The checkpoint with the lowest validation loss so far (``--save-best``), if any."""
    path = os.path.join(save_dir, BEST_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        lines = f.read().split()
    try:
        return BestCheckpoint(int(lines[0]), float(lines[1]))
    except (IndexError, ValueError):
        raise CheckpointError(f"{path}: expected 'ITERATION VALID_LOSS', "
                              f"got {' '.join(lines)[:80]!r}") from None


def list_iterations(save_dir: str) -> list[int]:
    """Iterations that have a complete (renamed) checkpoint folder in ``save_dir``, sorted."""
    if not os.path.isdir(save_dir):
        return []
    found = (_ITER_RE.fullmatch(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found
                  if m and os.path.isdir(os.path.join(save_dir, m.group(0))))


# ---------------------------------------------------------------------------------------------
# Small file-system helpers: every file that matters is written whole or not at all.


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def _write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _write_torch(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _legacy_safe_globals() -> list:
    """Types Megatron(-DeepSpeed)'s own checkpoints pickle: the argparse Namespace under
    'args' and numpy's RNG state. Allowed for those files only; none runs code on load."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    return [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32)), _reconstruct,
            (_reconstruct, "numpy.core.multiarray._reconstruct")]


def _read_torch(path: str, mmap: bool = False) -> dict:
    """``torch.load(weights_only=True)`` with errors that name the file.

    ``mmap``: tensors stay in the (page-cached) file until touched, so ranks that each need a
    slice of a large file read only that slice.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        with torch.serialization.safe_globals(_legacy_safe_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - zipfile, pickle and torch errors all mean "bad"
        size = os.path.getsize(path)
        raise CheckpointError(f"cannot read checkpoint file {path} ({size} bytes): it is "
                              f"truncated, corrupt or not a torch checkpoint "
                              f"({type(error).__name__}: {str(error)[:300]})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, "
                              "not a dict")
    return state


# ---------------------------------------------------------------------------------------------
# Where this rank sits, and the few collectives a save/load needs.


@dataclasses.dataclass(frozen=True)
class _Layout:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    rank: int = 0
    dp_group: Any = None

    @property
    def mp_rank_dir(self) -> str:
        return mp_rank_dir_name(self.tp_rank, self.pp_rank, self.pp_size)


def _current_layout() -> _Layout:
    if parallel_state.model_parallel_is_initialized():
        ps = parallel_state
        return _Layout(ps.get_tensor_model_parallel_rank(),
                       ps.get_tensor_model_parallel_world_size(),
                       ps.get_pipeline_model_parallel_rank(),
                       ps.get_pipeline_model_parallel_world_size(),
                       ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                       dist.get_rank(), ps.get_data_parallel_group())
    if dist.is_initialized():
        # No model-parallel groups: every rank is a data-parallel replica.
        return _Layout(dp_rank=dist.get_rank(), dp_size=dist.get_world_size(),
                       rank=dist.get_rank(), dp_group=dist.group.WORLD)
    return _Layout()


def _all_true(flag: bool) -> bool:
    """True when ``flag`` is true on every rank; doubles as a barrier."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32,
                     device=parallel_state.get_default_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_same_everywhere(value: int, what: str) -> None:
    if not dist.is_initialized():
        return
    t = torch.tensor([value, -value], dtype=torch.int64,
                     device=parallel_state.get_default_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != -t[1].item():
        raise CheckpointError(f"ranks disagree on {what} (between {-t[1].item()} and "
                              f"{t[0].item()}): is the checkpoint folder on a file system "
                              "that every node sees?")


# ---------------------------------------------------------------------------------------------
# Random number generators.


def _computes_on_cuda() -> bool:
    """Whether this run's generators include CUDA's (saved and restored only then)."""
    return parallel_state.get_default_device().type == "cuda"


def _capture_rng_state() -> dict:
    """Every generator this rank draws from, as tensors and plain values."""
    version, internal, gauss_next = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    cuda = _computes_on_cuda()
    return {
        "random_rng_state": [version, list(internal), gauss_next],
        "np_rng_state": {"algorithm": algorithm, "keys": torch.from_numpy(keys.astype(np.int64)),
                         "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached_gaussian)},
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if cuda else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
    }


def _restore_rng_state(state: dict) -> None:
    """Inverse of ``_capture_rng_state``; also takes Megatron's raw tuples and arrays."""
    version, internal, gauss_next = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["np_rng_state"]
    if isinstance(np_state, dict):
        keys = np_state["keys"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np_state = (np_state["algorithm"], keys.astype(np.uint32), np_state["pos"],
                    np_state["has_gauss"], np_state["cached_gaussian"])
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and _computes_on_cuda():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = get_rng_tracker()
    if tracker.fits(state["rng_tracker_states"]):
        tracker.set_states(state["rng_tracker_states"])
    else:
        # Saved on a GPU and loaded on the CPU, or the reverse: a CUDA generator's state
        # cannot seed a CPU one. Only dropout inside tensor-parallel regions draws from it.
        logger.warning("the checkpoint's tensor-parallel RNG states come from another device "
                       "type than this run's (%s): that dropout stream restarts from its seed",
                       tracker.device_type)


def _gather_rng_states(layout: _Layout) -> list[dict]:
    """Every data-parallel rank's RNG state, in data-parallel rank order (collective)."""
    mine = _capture_rng_state()
    if layout.dp_size == 1:
        return [mine]
    gathered: list[Any] = [None] * layout.dp_size
    dist.all_gather_object(gathered, mine, group=layout.dp_group)
    return gathered


def _rng_state_for(state: dict, layout: _Layout, path: str) -> Optional[dict]:
    """This rank's RNG entry of a checkpoint (ours: per dp rank; Megatron-DS: top level)."""
    if "rng_state" in state:
        entries = state["rng_state"]
        if len(entries) != layout.dp_size:
            # Saved at another data-parallel size: replicas draw the same numbers, take rank 0's.
            logger.info("%s holds RNG states of %d data-parallel ranks, this run has %d: using "
                        "data-parallel rank 0's", path, len(entries), layout.dp_size)
            return entries[0]
        return entries[layout.dp_rank]
    if "random_rng_state" in state:
        return state
    return None


# ---------------------------------------------------------------------------------------------
# Saving.


def _as_chunks(model_chunks: ModelChunks) -> list[nn.Module]:
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    return list(model_chunks)


def _model_keys(num_chunks: int) -> list[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def _config_dict(config: Any) -> dict:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dataclasses.asdict(config)


def _build_state(iteration: int, chunks: list[nn.Module], optimizer: Any, scheduler: Any,
                 config: Any, layout: _Layout, rng_states: Optional[list[dict]],
                 consumed: tuple[int, int], extra: Optional[dict]) -> dict:
    ckpt = config.checkpoint
    state: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(iteration),
        "config": _config_dict(config),
        "parallel_layout": {
            "tensor_model_parallel_size": layout.tp_size,
            "pipeline_model_parallel_size": layout.pp_size,
            "data_parallel_size": layout.dp_size,
            "num_model_chunks": len(chunks),
        },
        "consumed_train_samples": int(consumed[0]),
        "consumed_valid_samples": int(consumed[1]),
    }
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        state[key] = unwrap_model(chunk).state_dict()
    if not ckpt.no_save_optim:
        if isinstance(optimizer, DistributedOptimizer):
            state["distributed_optimizer"] = True  # its state is in distrib_optim.pt
        elif optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
    if rng_states is not None:
        state["rng_state"] = rng_states
    state.update(extra or {})
    return state


def _check_extra(extra: Optional[dict]) -> None:
    for key in extra or {}:
        if key in _RESERVED_KEYS or _MODEL_KEY_RE.fullmatch(key):
            raise ValueError(f"extra checkpoint entry {key!r} would overwrite a checkpoint key")


def _make_tmp_dir(save_dir: str, iteration: int, layout: _Layout) -> str:
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
    tmp_dir, problem = _broadcast_from_rank0((tmp_dir, problem))
    if problem is not None:
        raise CheckpointError(problem)
    return tmp_dir


def _write_rank_files(tmp_dir: str, layout: _Layout, state_fn, distrib_optim_state) -> None:
    if layout.dp_rank != 0:
        return
    folder = os.path.join(tmp_dir, layout.mp_rank_dir)
    os.makedirs(folder, exist_ok=True)
    _write_torch(state_fn(), os.path.join(folder, MODEL_FILENAME))
    if distrib_optim_state is not None:
        _write_torch(distrib_optim_state, os.path.join(folder, DISTRIB_OPTIM_FILENAME))


def _publish(save_dir: str, tmp_dir: str, iteration: int) -> Optional[str]:
    """Rename the finished folder into place; returns an older same-iteration folder's new
    name (to delete once the tracker is written), if there was one."""
    final = os.path.join(save_dir, iteration_dir_name(iteration))
    backup = None
    if os.path.lexists(final):
        backup = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, backup)
    os.rename(tmp_dir, final)
    _fsync_dir(save_dir)
    return backup


_LEFTOVER_RE = re.compile(r"iter_\d{7,}\.(tmp|old)-\w+")
# Temporary folders older than this process were left by a save that was killed (ours are
# created later); each save of rank 0 removes them.
_PROCESS_START = time.time()


def remove_leftover_folders(save_dir: str, older_than: Optional[float] = None) -> list[str]:
    """Delete ``iter_XXXXXXX.tmp-*`` / ``.old-*`` folders of killed saves that were last
    changed before ``older_than`` (default: this process's start). Returns their names."""
    older_than = _PROCESS_START if older_than is None else older_than
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if not _LEFTOVER_RE.fullmatch(name) or not os.path.isdir(path):
            continue
        try:
            if os.path.getmtime(path) >= older_than:
                continue  # possibly another run's save in progress
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
        logger.info("removed %s, left by an interrupted save", path)
    return removed


def prune_checkpoints(save_dir: str, keep_last: int, protect: Sequence[int] = ()) -> list[int]:
    """Delete ``iter_*`` folders older than the newest ``keep_last``, except ``protect``, the
    tracker's and the best one. Returns the deleted iterations."""
    keep = set(protect)
    tracker = read_tracker(save_dir)
    if tracker is not None and not tracker.release:
        keep.add(tracker.iteration)
    best = read_best(save_dir)
    if best is not None:
        keep.add(best.iteration)
    iterations = list_iterations(save_dir)
    keep.update(iterations[-keep_last:] if keep_last > 0 else [])
    deleted = [it for it in iterations if it not in keep]
    for it in deleted:
        shutil.rmtree(os.path.join(save_dir, iteration_dir_name(it)))
        logger.info("deleted old checkpoint %s (--keep-last-n-checkpoints %d)",
                    iteration_dir_name(it), keep_last)
    return deleted


def update_best_checkpoint(save_dir: str, iteration: int, valid_loss: float) -> bool:
    """Record ``iteration`` as the best checkpoint if ``valid_loss`` beats the recorded one.

    The best checkpoint's folder is exempt from ``--keep-last-n-checkpoints`` pruning. Writes
    from the calling process: in a distributed run call it on global rank 0 only
    (``save_checkpoint(..., valid_loss=...)`` does that). Returns whether it was recorded.
    """
    folder = os.path.join(save_dir, iteration_dir_name(iteration))
    if not os.path.isdir(folder):
        raise CheckpointError(f"cannot mark iteration {iteration} as the best checkpoint: "
                              f"{folder} does not exist")
    if not math.isfinite(valid_loss):
        return False
    best = read_best(save_dir)
    if best is not None and not valid_loss < best.valid_loss:
        return False
    _write_text_atomic(os.path.join(save_dir, BEST_FILENAME), f"{iteration}\n{valid_loss!r}\n")
    return True


def _finish_on_rank0(save_dir: str, tmp_dir: str, iteration: int, config: Any,
                     valid_loss: Optional[float]) -> None:
    ckpt = config.checkpoint
    backup = _publish(save_dir, tmp_dir, iteration)
    _write_text_atomic(os.path.join(save_dir, TRACKER_FILENAME), str(iteration))
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    remove_leftover_folders(save_dir)
    if ckpt.save_best and valid_loss is not None:
        update_best_checkpoint(save_dir, iteration, valid_loss)
    if ckpt.keep_last_n_checkpoints is not None:
        prune_checkpoints(save_dir, ckpt.keep_last_n_checkpoints, protect=[iteration])


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
    _check_extra(extra)
    chunks = _as_chunks(model_chunks)
    layout = _current_layout()
    logger.info("saving checkpoint at iteration %7d to %s", iteration, save_dir)

    rng_states = None if ckpt.no_save_rng else _gather_rng_states(layout)
    distrib_optim_state = None
    if isinstance(optimizer, DistributedOptimizer) and not ckpt.no_save_optim:
        distrib_optim_state = optimizer.state_dict()  # collective over data parallel
    tmp_dir = _make_tmp_dir(save_dir, iteration, layout)

    def state_fn() -> dict:
        return _build_state(iteration, chunks, optimizer, opt_param_scheduler, config, layout,
                            rng_states, (consumed_train_samples, consumed_valid_samples), extra)

    error = None
    try:
        _write_rank_files(tmp_dir, layout, state_fn, distrib_optim_state)
    except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
        error = e
    if not _all_true(error is None):
        if layout.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _raise_save_failure(error, layout, iteration, save_dir)

    error = None
    if layout.rank == 0:
        try:
            _finish_on_rank0(save_dir, tmp_dir, iteration, config, valid_loss)
        except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
            error = e
    if not _all_true(error is None):
        _raise_save_failure(error, layout, iteration, save_dir)
    logger.info("successfully saved checkpoint at iteration %7d to %s", iteration, save_dir)
    return os.path.join(save_dir, iteration_dir_name(iteration))


def _raise_save_failure(error: Optional[BaseException], layout: _Layout, iteration: int,
                        save_dir: str) -> None:
    where = f"saving the checkpoint of iteration {iteration} to {save_dir} failed"
    if error is not None:
        raise CheckpointError(f"{where} on rank {layout.rank}: {error}; the tracker file still "
                              "names the previous checkpoint") from error
    raise CheckpointError(f"{where} on another rank (see its error); the tracker file still "
                          "names the previous checkpoint")


# ---------------------------------------------------------------------------------------------
# Loading.


def _iteration_dir(load_dir: str, tracker: Tracker) -> str:
    """The tracker's folder; or, after a crash in the middle of replacing a checkpoint of the
    same iteration, the older copy that was being replaced."""
    final = os.path.join(load_dir, iteration_dir_name(tracker.iteration, tracker.release))
    if os.path.isdir(final):
        return final
    backups = sorted(glob.glob(glob.escape(final) + ".old-*"), key=os.path.getmtime)
    if backups:
        logger.warning("%s is missing; loading %s (a save of the same iteration was "
                       "interrupted)", final, backups[-1])
        return backups[-1]
    raise CheckpointError(f"{os.path.join(load_dir, TRACKER_FILENAME)} names "
                          f"{os.path.basename(final)}, but {final} does not exist")


def _saved_layout(iter_dir: str) -> tuple[int, int]:
    """(tensor, pipeline) sizes a checkpoint folder was saved with, from its mp_rank_* names."""
    found = [m for m in map(_MP_RANK_RE.fullmatch, sorted(os.listdir(iter_dir))) if m]
    if not found:
        hint = ""
        if glob.glob(os.path.join(iter_dir, "*model_states.pt")):
            hint = " (it looks like a DeepSpeed checkpoint: load it with --deepspeed)"
        raise CheckpointError(f"{iter_dir} has no mp_rank_* folders{hint}")
    tp = 1 + max(int(m.group(1)) for m in found)
    pp = 1 + max(int(m.group(2)) if m.group(2) else 0 for m in found)
    return tp, pp


def _check_layout(iter_dir: str, layout: _Layout) -> None:
    saved = _saved_layout(iter_dir)
    now = (layout.tp_size, layout.pp_size)
    if saved != now:
        raise CheckpointLayoutError(
            f"checkpoint {iter_dir} was saved with tensor-model-parallel size {saved[0]} and "
            f"pipeline-model-parallel size {saved[1]} (tp={saved[0]}, pp={saved[1]}); this run "
            f"has tp={now[0]}, pp={now[1]}. Run with the saved layout, or {RESHARD_HINT}")


def _load_model(state: dict, chunks: list[nn.Module], path: str, strict: bool) -> None:
    keys = sorted((k for k in state if _MODEL_KEY_RE.fullmatch(k)),
                  key=lambda k: int(k[5:] or 0))
    if keys != _model_keys(len(chunks)):
        raise CheckpointLayoutError(
            f"{path} holds {len(keys)} model chunk(s) ({', '.join(keys) or 'none'}), this run "
            f"has {len(chunks)} (virtual pipeline size): run with the saved "
            f"--num-layers-per-virtual-pipeline-stage, or {RESHARD_HINT}")
    for key, chunk in zip(keys, chunks):
        try:
            unwrap_model(chunk).load_state_dict(state[key], strict=strict)
        except RuntimeError as error:
            raise CheckpointError(f"{path}: '{key}' does not fit this model: {error}") from error


def _consumed_samples(state: dict) -> tuple[int, int]:
    if "consumed_train_samples" in state:
        return int(state["consumed_train_samples"]), int(state.get("consumed_valid_samples", 0))
    args = state.get("args")  # Megatron keeps them in its argparse Namespace
    return (int(getattr(args, "consumed_train_samples", 0) or 0),
            int(getattr(args, "consumed_valid_samples", 0) or 0))


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
    return _read_torch(os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILENAME), mmap=True)


def _load_optimizer(state: dict, distrib_state: Optional[dict], optimizer: Any,
                    scheduler: Any, path: str) -> bool:
    """Restore the optimizer (and the scheduler, if given); returns whether the scheduler's
    state was restored (a checkpoint may hold none)."""
    if optimizer is not None:
        if distrib_state is not None:
            optimizer.load_state_dict(distrib_state)  # collective over data parallel
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


def load_checkpoint(model_chunks: ModelChunks, optimizer: Any, opt_param_scheduler: Any,
                    config: Any, *, strict: bool = True) -> LoadedCheckpoint:
    """Load the latest checkpoint of ``config.checkpoint.load`` into this rank's model.

    Returns ``(iteration, consumed_train_samples, consumed_valid_samples)`` (and ``.extra``):
    zeros when there is no ``--load`` or no tracker file in it. ``--finetune`` and release
    checkpoints load the weights only and restart at iteration 0; ``--no-load-optim`` skips
    the optimizer and scheduler, ``--no-load-rng`` the generators. Every rank must call it.
    """
    ckpt = config.checkpoint
    if ckpt.load is None:
        return LoadedCheckpoint()
    tracker = read_tracker(ckpt.load)
    _check_same_everywhere(-1 if tracker is None else tracker.iteration, "the latest iteration")
    if tracker is None:
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint in --load "
                                  f"{ckpt.load} (no {TRACKER_FILENAME} there)")
        logger.warning("no %s in %s: starting from scratch", TRACKER_FILENAME, ckpt.load)
        return LoadedCheckpoint()

    chunks = _as_chunks(model_chunks)
    layout = _current_layout()
    model_only = ckpt.finetune or tracker.release
    load_optim = not model_only and not ckpt.no_load_optim
    error, state, distrib_state, path = None, {}, None, ""
    try:
        iter_dir = _iteration_dir(ckpt.load, tracker)
        _check_layout(iter_dir, layout)
        path = os.path.join(iter_dir, layout.mp_rank_dir, MODEL_FILENAME)
        logger.info("loading checkpoint from %s at iteration %d", ckpt.load, tracker.iteration)
        state = _read_torch(path)
        _check_version(state, path)
        _load_model(state, chunks, path, strict)
        if load_optim:
            distrib_state = _read_distrib_optim(state, optimizer, path)
    except Exception as e:  # noqa: BLE001 - decide together before any collective
        error = e
    if not _all_true(error is None):
        if error is not None:
            raise error
        raise CheckpointError(f"loading the checkpoint from {ckpt.load} failed on another rank "
                              "(see its error)")

    scheduler_loaded = False
    if load_optim:
        scheduler = None if ckpt.no_load_lr_state else opt_param_scheduler
        scheduler_loaded = _load_optimizer(state, distrib_state, optimizer, scheduler, path)
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main copies must follow the loaded weights
    if not model_only and not ckpt.no_load_rng:
        rng = _rng_state_for(state, layout, path)
        if rng is None:
            raise CheckpointError(f"{path} has no RNG state (saved with --no-save-rng?): "
                                  "pass --no-load-rng")
        _restore_rng_state(rng)

    report = LoadReport(iter_dir, tracker.iteration, tracker.release, load_optim,
                        scheduler_loaded, not model_only and not ckpt.no_load_rng)
    if model_only:
        return LoadedCheckpoint(0, 0, 0, _extra_entries(state), report)
    return LoadedCheckpoint(int(state["iteration"]), *_consumed_samples(state),
                            extra=_extra_entries(state), report=report)


def _check_version(state: dict, path: str) -> None:
    version = state.get("checkpoint_version", 0)
    if version < 3.0:
        raise CheckpointError(f"{path} has checkpoint_version {version}: checkpoints older than "
                              f"3.0 order the query/key/value weights differently; "
                              f"{RESHARD_HINT.split(' (')[0]} first")
    if "iteration" not in state:
        raise CheckpointError(f"{path} has no 'iteration' entry")


def _extra_entries(state: dict) -> dict:
    return {k: v for k, v in state.items()
            if k not in _RESERVED_KEYS and not _MODEL_KEY_RE.fullmatch(k)}


def load_checkpoint_config(load_dir: str) -> Optional[dict]:
    """The run configuration stored in the latest checkpoint of ``load_dir`` (plain dicts),
    or None if there is no checkpoint or it stores none (for ``--use-checkpoint-args``)."""
    tracker = read_tracker(load_dir)
    if tracker is None:
        return None
    iter_dir = _iteration_dir(load_dir, tracker)
    _, pp = _saved_layout(iter_dir)
    state = _read_torch(os.path.join(iter_dir, mp_rank_dir_name(0, 0, pp), MODEL_FILENAME))
    config = state.get("config")
    if config is None and isinstance(state.get("args"), argparse.Namespace):
        return dict(vars(state["args"]))
    return config


__all__ = [
    "BEST_FILENAME",
    "CHECKPOINT_VERSION",
    "DISTRIB_OPTIM_FILENAME",
    "MODEL_FILENAME",
    "TRACKER_FILENAME",
    "BestCheckpoint",
    "CheckpointError",
    "CheckpointLayoutError",
    "LoadReport",
    "LoadedCheckpoint",
    "Tracker",
    "checkpoint_path",
    "iteration_dir_name",
    "list_iterations",
    "load_checkpoint",
    "load_checkpoint_config",
    "mp_rank_dir_name",
    "prune_checkpoints",
    "read_best",
    "read_tracker",
    "save_checkpoint",
    "update_best_checkpoint",
]

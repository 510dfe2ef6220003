"""Saving in Megatron's torch format: every rank writes into one temporary folder, global rank 0
adds the manifest and renames the folder into place, and only then moves the tracker file.

The distributed optimizer's state goes to data-parallel rank 0 one parameter at a time
(``shard_gather``) and streams into ``distrib_optim.pt`` as it arrives, so no rank holds more
than its own shard plus one parameter's buffer. With an ``AsyncSaver`` (``--async-save``) the
state is copied to host memory first and the files are written in the background
(async_save.py); without one, ``save_checkpoint`` returns once the checkpoint is published.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.async_save import AsyncSaver, run_job
from megatron.checkpointing.contents import (
    ModelChunks,
    as_chunks,
    build_state,
    check_extra,
    config_dict,
    parallel_layout_dict,
)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import (
    Deferred,
    FileDigest,
    write_torch,
    write_torch_streamed,
)
from megatron.checkpointing.folder import (
    iteration_dir_name,
    make_tmp_folder,
)
from megatron.checkpointing.paths import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME
from megatron.checkpointing.publish import PublishedSave
from megatron.checkpointing.ranks import RankLayout, broadcast_from_rank0, current_layout
from megatron.checkpointing.rng import gather_rng_states
from megatron.core import parallel_state
from megatron.core.nonfinite import first_nonfinite_of
from megatron.core.optimizer.distrib_optimizer import GATHERED_FORMAT
from megatron.core.optimizer.optimizer import shards_state
from megatron.core.optimizer.shard_gather import ShardSnapshot, gather_to_first
from megatron.platform import xla

logger = logging.getLogger(__name__)


def save_checkpoint(iteration: int, model_chunks: ModelChunks, optimizer: Any,
                    opt_param_scheduler: Any, config: Any, *, consumed_train_samples: int,
                    consumed_valid_samples: int = 0, extra: Optional[dict] = None,
                    valid_loss: Optional[float] = None,
                    saver: Optional[AsyncSaver] = None, refuse_nonfinite: bool = False) -> str:
    """Save a checkpoint of ``iteration`` to ``config.checkpoint.save``; returns its folder.

    Every rank must call it (it gathers RNG states, and the distributed optimizer's state,
    over data parallel). ``extra`` entries become top-level keys of every
    ``model_optim_rng.pt`` (plain values or tensors). With ``--save-best`` and a
    ``valid_loss``, the checkpoint is recorded as the best one if its loss is the lowest.
    Raises ``CheckpointError`` if any rank fails; the previous checkpoint stays the latest.
    With ``saver`` the files are written in the background: this returns once the state is
    copied to host memory, and ``saver.poll()`` / ``saver.wait()`` publish the folder (or
    raise the failure) later. ``refuse_nonfinite``: the write fails, naming the tensor, if
    what it would write holds NaN/Inf (checked on the copy, off the training loop's time).
    """
    ckpt = config.checkpoint
    if ckpt.save is None:
        raise CheckpointError("save_checkpoint needs --save")
    check_extra(extra)
    chunks = as_chunks(model_chunks)
    layout = current_layout()
    background = saver is not None
    if background:
        saver.wait()  # one save at a time: the previous one is published first
    logger.info("saving checkpoint at iteration %7d to %s%s", iteration, ckpt.save,
                " (written in the background)" if background else "")
    started = time.perf_counter()
    if background:
        saver.buffers.restart()
    rng_states = None if ckpt.no_save_rng else gather_rng_states(layout)
    if ckpt.ckpt_format == "torch_dist":
        from megatron.checkpointing.torch_dist import start_save

        job = start_save(iteration, chunks, optimizer, opt_param_scheduler, config, layout,
                         rng_states, (consumed_train_samples, consumed_valid_samples), extra,
                         valid_loss, lambda: _make_tmp_dir(ckpt.save, iteration, layout), saver,
                         refuse_nonfinite)
    else:
        job = _torch_job(iteration, chunks, optimizer, opt_param_scheduler, config, layout,
                         rng_states, (consumed_train_samples, consumed_valid_samples), extra,
                         valid_loss, saver, refuse_nonfinite)
    if saver is None:
        return run_job(job)
    saver.start(job)
    logger.info("checkpoint of iteration %7d copied to host memory in %.2f s; training goes on "
                "while it is written", iteration, time.perf_counter() - started)
    return job.folder


def _torch_job(iteration: int, chunks: list, optimizer: Any, opt_param_scheduler: Any,
               config: Any, layout: RankLayout, rng_states: Optional[list[dict]],
               consumed: tuple[int, int], extra: Optional[dict], valid_loss: Optional[float],
               saver: Optional[AsyncSaver], refuse_nonfinite: bool) -> TorchSaveJob:
    """Take the state a torch-format save writes (host copies for a background save)."""
    ckpt = config.checkpoint
    copy_to_host = saver.buffers.copy if saver is not None else None
    shards, model_state, problem = _torch_state(iteration, chunks, optimizer,
                                                opt_param_scheduler, config, layout,
                                                rng_states, consumed, extra, copy_to_host)
    return TorchSaveJob(
        iteration=iteration, save_dir=ckpt.save,
        tmp_dir=_make_tmp_dir(ckpt.save, iteration, layout), layout=layout,
        manifest_layout=parallel_layout_dict(layout, len(chunks)),
        config=config_dict(config), checkpoint=ckpt, valid_loss=valid_loss,
        model_state=model_state, shards=shards,
        transfer=_transfer(layout, saver), problem=problem,
        refuse_nonfinite=refuse_nonfinite)


def _torch_state(iteration: int, chunks: list, optimizer: Any, opt_param_scheduler: Any,
                 config: Any, layout: RankLayout, rng_states: Optional[list[dict]],
                 consumed: tuple[int, int], extra: Optional[dict],
                 copy_to_host: Optional[Callable[[torch.Tensor], torch.Tensor]]
                 ) -> tuple[Any, Optional[dict], Optional[Exception]]:
    """What a torch-format save takes: the distributed optimizer's shard snapshot, and on
    data-parallel rank 0 the model file's dict (or the error making it)."""
    shards = None
    if shards_state(optimizer) and not config.checkpoint.no_save_optim:
        shards = optimizer.shard_snapshot(copy_to_host)  # collective over data parallel
    model_state, problem = None, None
    if layout.dp_rank == 0:  # the replicas' model files would be the same
        try:
            # Saved from the host: XLA tensors become CPU ones, loadable without torch_xla.
            model_state = xla.to_host(build_state(iteration, chunks, optimizer,
                                                  opt_param_scheduler, config, layout,
                                                  rng_states, consumed, extra))
            if copy_to_host is not None:
                model_state = host_copy(model_state, copy_to_host)
        except Exception as error:  # noqa: BLE001 - raised by write(), so the ranks vote
            problem = error
    return shards, model_state, problem


def reserve_host_buffers(iteration: int, model_chunks: ModelChunks, optimizer: Any,
                         opt_param_scheduler: Any, config: Any, saver: AsyncSaver) -> None:
    """--async-save: allocate the host memory of this run's saves now, in the background
    (``HostBuffers.reserve``), so that the first save stops the loop no longer than later
    ones. Every rank calls it at the same point (it takes the state as a save does, a
    collective), after the optimizer's state exists; nothing is copied or written."""
    specs: list[tuple[torch.Size, torch.dtype, bool]] = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        specs.append((tensor.shape, tensor.dtype, tensor.is_cuda))
        return tensor

    chunks = as_chunks(model_chunks)
    layout = current_layout()
    saver.buffers.restart()  # the previous reservation's thread, if any, has finished
    rng_states = None if config.checkpoint.no_save_rng else gather_rng_states(layout)
    if config.checkpoint.ckpt_format == "torch_dist":
        from megatron.checkpointing.torch_dist import prepare_save

        prepare_save(iteration, chunks, optimizer, opt_param_scheduler, config, layout,
                     rng_states, (0, 0), None, copy_to_host=record)
    else:
        _torch_state(iteration, chunks, optimizer, opt_param_scheduler, config, layout,
                     rng_states, (0, 0), None, record)
    saver.buffers.reserve(specs)


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


class _Transfer(NamedTuple):
    """How the distributed optimizer's pieces reach data-parallel rank 0."""

    group: Any
    dp_ranks: list[int]  # global rank of each data-parallel rank
    device: torch.device


def _transfer(layout: RankLayout, saver: Optional[AsyncSaver]) -> _Transfer:
    ranks = (dist.get_process_group_ranks(layout.dp_group)
             if dist.is_initialized() and layout.dp_group is not None else [0])
    if saver is not None:  # from the writer thread: the saver's own gloo group, host memory
        return _Transfer(saver.group, ranks, torch.device("cpu"))
    return _Transfer(layout.dp_group, ranks, parallel_state.get_default_device()
                     if dist.is_initialized() else torch.device("cpu"))


@dataclasses.dataclass
class TorchSaveJob(PublishedSave):
    """One save in the torch format (a ``SaveJob``): what this rank writes."""

    layout: RankLayout
    model_state: Optional[dict]  # data-parallel rank 0: model_optim_rng.pt's dict
    shards: Optional[ShardSnapshot]  # the distributed optimizer's share of this rank
    transfer: _Transfer
    problem: Optional[Exception] = None  # what went wrong taking the state, raised by write
    refuse_nonfinite: bool = False

    def write(self) -> dict[str, FileDigest]:
        """Data-parallel rank 0 of each (tensor, pipeline) rank writes model_optim_rng.pt
        and, with the distributed optimizer, distrib_optim.pt (the other data-parallel ranks
        send it their pieces); returns the digests by path relative to the folder."""
        layout, digests, error = self.layout, {}, self.problem
        if error is None and self.refuse_nonfinite:
            error = self._nonfinite()
        if layout.dp_rank == 0 and error is None:
            folder = os.path.join(self.tmp_dir, layout.mp_rank_dir)
            try:
                os.makedirs(folder, exist_ok=True)
                digests[f"{layout.mp_rank_dir}/{MODEL_FILENAME}"] = write_torch(
                    self.model_state, os.path.join(folder, MODEL_FILENAME))
            except Exception as e:  # noqa: BLE001 - raised once the optimizer pieces are in
                error = e
            self.model_state = None  # a background save frees its host copy as it goes
        if self.shards is not None:
            # The other data-parallel ranks send their pieces whatever happened here: take
            # them (writing nothing after an error) so that no rank waits forever.
            digests.update(self._write_optimizer(write=error is None))
        if error is not None:
            raise error
        return digests

    def _nonfinite(self) -> Optional[CheckpointError]:
        """An error naming the first tensor this rank would write that holds NaN/Inf."""
        named = list(_floating(self.model_state or {}, ""))
        for (chunk, name), piece in (self.shards.own.items() if self.shards else ()):
            prefix = f"model chunk {chunk} " if self.shards.num_chunks > 1 else ""
            named += [(f"{prefix}optimizer state {key!r} of {name}", t)
                      for key, t in piece.items()]
        what = first_nonfinite_of(named)
        if what is None:
            return None
        return CheckpointError(f"refusing to save the checkpoint of iteration "
                               f"{self.iteration}: {what} holds NaN/Inf")

    def _write_optimizer(self, write: bool) -> dict[str, FileDigest]:
        t = self.transfer
        tensors = gather_to_first(self.shards, t.group, t.dp_ranks, t.device)
        if self.layout.dp_rank != 0 or not write:
            for _ in tensors:  # sends this rank's pieces (or takes the others', unwritten)
                pass
            return {}
        skeleton, deferred = gathered_skeleton(self.shards)
        rel = f"{self.layout.mp_rank_dir}/{DISTRIB_OPTIM_FILENAME}"
        path = os.path.join(self.tmp_dir, *rel.split("/"))
        return {rel: write_torch_streamed(skeleton, path, deferred, tensors)}


def _floating(obj: Any, path: str):
    """``(path, tensor)`` for the floating-point tensors of a rank file's dict (random
    generator states left out)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if key != "rng_state":
                yield from _floating(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _floating(value, f"{path}[{i}]")


def gathered_skeleton(shards: ShardSnapshot) -> tuple[dict, list[Deferred]]:
    """``DistributedOptimizer.gathered_state_dict()``'s dict with a ``Deferred`` for each
    (parameter, key) tensor, in the order ``gather_to_first`` gives them."""
    deferred: list[Deferred] = []
    param_state: list[dict] = [{} for _ in range(shards.num_chunks)]
    for param, key in shards.entries():
        d = Deferred(len(deferred), param.shape)
        deferred.append(d)
        param_state[param.chunk].setdefault(param.name, {})[key] = d
    return {"format": GATHERED_FORMAT, "param_groups": shards.param_groups, "step": shards.step,
            "param_state": param_state, "grad_scaler": shards.grad_scaler}, deferred


def _make_tmp_dir(save_dir: str, iteration: int, layout: RankLayout) -> str:
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

"""Saving in Megatron's torch format: data-parallel rank 0 of each (tensor, pipeline) rank
writes ``mp_rank_TT[_PPP]/model_optim_rng.pt``; with the distributed optimizer its state goes
to data-parallel rank 0 one parameter at a time (``shard_gather``) and streams into
``distrib_optim.pt`` as it arrives, so no rank holds more than its own shard plus one
parameter's buffer."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.async_save import AsyncSaver
from megatron.checkpointing.contents import build_state, config_dict, parallel_layout_dict
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import Deferred, FileDigest, write_torch, write_torch_streamed
from megatron.checkpointing.format import SaveRequest
from megatron.checkpointing.formats.torch.experts import (
    gathered_for_save,
    gathered_optimizer_for_save,
)
from megatron.checkpointing.paths import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME
from megatron.checkpointing.publish import PublishedSave, host_copy, make_tmp_dir
from megatron.checkpointing.ranks import RankLayout
from megatron.core import parallel_state
from megatron.core.nonfinite import first_nonfinite_of
from megatron.core.optimizer.distrib_optimizer import GATHERED_FORMAT
from megatron.core.optimizer.optimizer import shards_state
from megatron.core.optimizer.shard_gather import ShardSnapshot, gather_to_first
from megatron.platform import xla


def start_save(request: SaveRequest) -> TorchSaveJob:
    """Take the state a torch-format save writes (host copies for a background save)."""
    r = request
    ckpt = r.config.checkpoint
    copy_to_host = r.saver.buffers.copy if r.saver is not None else None
    shards, model_state, problem, whole_optimizer = take_state(r, copy_to_host)
    return TorchSaveJob(
        iteration=r.iteration, save_dir=ckpt.save,
        tmp_dir=make_tmp_dir(ckpt.save, r.iteration, r.layout), layout=r.layout,
        manifest_layout=parallel_layout_dict(r.layout, len(r.chunks)),
        config=config_dict(r.config), checkpoint=ckpt, valid_loss=r.valid_loss,
        model_state=model_state, shards=shards, whole_optimizer=whole_optimizer,
        transfer=_transfer(r.layout, r.saver), problem=problem,
        refuse_nonfinite=r.refuse_nonfinite)


def take_state(r: SaveRequest, copy_to_host: Optional[Callable[[torch.Tensor], torch.Tensor]]
               ) -> tuple[Any, Optional[dict], Optional[Exception], Optional[dict]]:
    """What a torch-format save takes: the distributed optimizer's shard snapshot, and on
    data-parallel rank 0 the model file's dict (or the error making it); under expert
    parallelism the distributed optimizer's whole gathered state instead of the snapshot
    (``experts.gathered_optimizer_for_save``)."""
    shards, whole_optimizer = None, None
    if shards_state(r.optimizer) and not r.config.checkpoint.no_save_optim:
        whole_optimizer = gathered_optimizer_for_save(r.chunks, r.optimizer)
        if whole_optimizer is None:
            shards = r.optimizer.shard_snapshot(copy_to_host)  # collective over data parallel
        elif copy_to_host is not None:
            whole_optimizer = host_copy(whole_optimizer, copy_to_host)
        if r.layout.dp_rank != 0:
            whole_optimizer = None
    model_state, problem = None, None
    save_optim = not r.config.checkpoint.no_save_optim and not shards_state(r.optimizer)
    # Under expert parallelism every rank of an expert group brings its experts.
    whole = gathered_for_save(r.chunks, r.optimizer, save_optim)
    if r.layout.dp_rank == 0:  # the replicas' model files would be the same
        try:
            # Saved from the host: XLA tensors become CPU ones, loadable without torch_xla.
            model_state = xla.to_host(build_state(r.iteration, r.chunks, r.optimizer,
                                                  r.scheduler, r.config, r.layout,
                                                  r.rng_states, r.consumed, r.extra,
                                                  whole=whole))
            if copy_to_host is not None:
                model_state = host_copy(model_state, copy_to_host)
        except Exception as error:  # noqa: BLE001 - raised by write(), so the ranks vote
            problem = error
    return shards, model_state, problem, whole_optimizer


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
    # Data-parallel rank 0 under expert parallelism: distrib_optim.pt's whole dict.
    whole_optimizer: Optional[dict] = None
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
                if self.whole_optimizer is not None:
                    digests[f"{layout.mp_rank_dir}/{DISTRIB_OPTIM_FILENAME}"] = write_torch(
                        self.whole_optimizer, os.path.join(folder, DISTRIB_OPTIM_FILENAME))
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

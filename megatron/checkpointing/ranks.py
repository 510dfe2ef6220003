"""Where this rank sits in the parallel layout, and the few collectives a save or load needs.

Control values travel as tensors on the run's device (``parallel_state.get_default_device()``)
so they work over NCCL too; Python objects go through torch's object collectives, which place
their buffers on the current CUDA device themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.paths import mp_rank_dir_name
from megatron.core import parallel_state


@dataclasses.dataclass(frozen=True)
class RankLayout:
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


def current_layout() -> RankLayout:
    if parallel_state.model_parallel_is_initialized():
        ps = parallel_state
        return RankLayout(ps.get_tensor_model_parallel_rank(),
                          ps.get_tensor_model_parallel_world_size(),
                          ps.get_pipeline_model_parallel_rank(),
                          ps.get_pipeline_model_parallel_world_size(),
                          # Context-parallel ranks hold the same weights as data-parallel
                          # ones: a checkpoint sees them all as replicas.
                          ps.get_data_parallel_rank(with_context_parallel=True),
                          ps.get_data_parallel_world_size(with_context_parallel=True),
                          dist.get_rank(), ps.get_data_parallel_group(with_context_parallel=True))
    if dist.is_initialized():
        # No model-parallel groups: every rank is a data-parallel replica.
        return RankLayout(dp_rank=dist.get_rank(), dp_size=dist.get_world_size(),
                          rank=dist.get_rank(), dp_group=dist.group.WORLD)
    return RankLayout()


def _reduce_flag(flag: bool, op: dist.ReduceOp) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32,
                     device=parallel_state.get_control_device())
    dist.all_reduce(t, op=op, group=parallel_state.get_control_group())
    return bool(t.item())


def all_true(flag: bool) -> bool:
    """True when ``flag`` is true on every rank; doubles as a barrier."""
    return _reduce_flag(flag, dist.ReduceOp.MIN)


def any_true(flag: bool) -> bool:
    """True when ``flag`` is true on any rank (collective over all ranks)."""
    return _reduce_flag(flag, dist.ReduceOp.MAX)


def broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=parallel_state.get_control_group())
    return box[0]


def gather_to_all(value: Any) -> list[Any]:
    """Every rank's ``value``, in global rank order (collective over all ranks)."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=parallel_state.get_control_group())
    return gathered


def first_failure(error: Optional[BaseException]) -> tuple[int, str]:
    """After a vote that failed (every rank calls it): the lowest failing rank and its
    error's message, so that rank 0, which speaks for all, names the real cause. ``error``:
    this rank's, None when it did not fail."""
    failures = gather_to_all(None if error is None else str(error))
    return next((r, m) for r, m in enumerate(failures) if m is not None)


def raise_together(error: Optional[BaseException]) -> None:
    """After each rank tried something that can fail on it alone (``error``: its own, None
    when it succeeded), decide together (collective over all ranks): when any failed, every
    rank raises, its own error where it failed, elsewhere a ``CheckpointError`` "on rank R:
    ..." with the lowest failing rank's message, so that none waits in a collective for a
    rank that stopped and rank 0, which speaks for all, names the real cause."""
    if all_true(error is None):
        return
    rank, message = first_failure(error)
    if error is not None:
        raise error
    raise CheckpointError(f"on rank {rank}: {message}")


def check_same_everywhere(value: int, what: str) -> None:
    if not dist.is_initialized():
        return
    t = torch.tensor([value, -value], dtype=torch.int64,
                     device=parallel_state.get_control_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel_state.get_control_group())
    if t[0].item() != -t[1].item():
        raise CheckpointError(f"ranks disagree on {what} (between {-t[1].item()} and "
                              f"{t[0].item()}): is the checkpoint folder on a file system "
                              "that every node sees?")

"""Process groups for tensor, context, pipeline and data parallelism, in Megatron's rank order.

Ranks are laid out with the tensor-parallel index varying fastest, then the context-parallel
index, then the data-parallel index, then the pipeline stage (Megatron-LM's ``tp-cp-dp-pp``):
``rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank``. The
context-parallel ranks of one replica split each sequence (``megatron.core.context_parallel``)
and hold the same weights, so gradients and optimizer shards go over the data x context group
(``data_context``), while the data group alone decides which samples a rank reads.
``build_rank_groups`` is the pure arithmetic (testable without processes);
``initialize_model_parallel`` turns it into torch.distributed groups and keeps them here,
the one place that holds process-group state.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankGroups:
    """Every group of each kind, as lists of global ranks."""

    tensor: list[list[int]]
    pipeline: list[list[int]]
    data: list[list[int]]
    model: list[list[int]]
    embedding: list[list[int]]
    position_embedding: list[list[int]]
    context: list[list[int]]
    data_context: list[list[int]]
    expert: list[list[int]]
    expert_data: list[list[int]]

    def containing(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that holds ``rank`` (empty if none, e.g. embedding groups)."""
        for group in getattr(self, kind):
            if rank in group:
                return group
        return []


def build_rank_groups(world_size: int, tensor_model_parallel_size: int = 1,
                      pipeline_model_parallel_size: int = 1,
                      context_parallel_size: int = 1,
                      expert_model_parallel_size: int = 1) -> RankGroups:
    """The rank lists of every process group, as Megatron lays them out.

    Expert parallelism splits each data-parallel group (ranks of one tensor and pipeline
    position) into runs of ``expert_model_parallel_size`` consecutive members, the expert
    groups (megatron-core's tp-ep-dp-pp order with the experts cut over the tensor ranks as
    the dense MLP is); the members at the same place of each run hold the same experts and
    form the expert-data-parallel groups."""
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep = expert_model_parallel_size
    if min(tp, pp, cp, world_size) < 1 or world_size % (tp * pp * cp) != 0:
        with_cp = f" x context-parallel size ({cp})" if cp > 1 else ""
        raise ValueError(
            f"world size ({world_size}) is not divisible by tensor-model-parallel size ({tp}) "
            f"x pipeline-model-parallel size ({pp}){with_cp}"
        )
    dp = world_size // (tp * pp * cp)
    ranks_per_stage = tp * cp * dp

    def rank(p: int, d: int, c: int, t: int) -> int:
        return p * ranks_per_stage + d * cp * tp + c * tp + t

    tensor = [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)]
    data = [[rank(p, d, c, t) for d in range(dp)]
            for p in range(pp) for c in range(cp) for t in range(tp)]
    context = [[rank(p, d, c, t) for c in range(cp)]
               for p in range(pp) for d in range(dp) for t in range(tp)]
    data_context = [sorted(rank(p, d, c, t) for d in range(dp) for c in range(cp))
                    for p in range(pp) for t in range(tp)]
    num_pipeline_groups = world_size // pp
    pipeline = [list(range(i, world_size, num_pipeline_groups)) for i in range(num_pipeline_groups)]
    # A model-parallel group: every rank that holds part of one model replica (same data and
    # context index).
    model = [[rank(p, d, c, t) for p in range(pp) for t in range(tp)]
             for d in range(dp) for c in range(cp)]
    embedding = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in pipeline]
    position_embedding = [[g[0]] for g in pipeline]
    if ep < 1 or dp % ep != 0 or (ep > 1 and cp > 1):
        raise ValueError(f"the data-parallel size ({dp}) is not divisible by the expert-model-"
                         f"parallel size ({ep})" if cp == 1 else
                         "expert parallelism does not combine with context parallelism")
    expert = [g[i:i + ep] for g in data for i in range(0, dp, ep)]
    expert_data = [g[i::ep] for g in data for i in range(ep)]
    return RankGroups(tensor, pipeline, data, model, embedding, position_embedding, context,
                      data_context, expert, expert_data)


class _State:
    """The groups of this process; reset by destroy_model_parallel."""

    def __init__(self) -> None:
        self.groups: Optional[RankGroups] = None
        self.tensor = self.pipeline = self.data = self.model = None
        self.context = self.data_context = None
        self.expert = self.expert_data = None
        self.embedding = self.position_embedding = None
        self.pipeline_ranks: list[int] = []
        self.embedding_ranks: list[int] = []
        self.position_embedding_ranks: list[int] = []
        self.data_ranks: list[int] = []
        self.context_ranks: list[int] = []
        self.data_context_ranks: list[int] = []
        self.virtual_pipeline_world_size: Optional[int] = None
        self.virtual_pipeline_rank: Optional[int] = None
        self.timeout: Optional[datetime.timedelta] = None  # of every group made here
        self.members: dict[str, list[int]] = {}  # torch's group name -> global ranks
        # Groups made elsewhere and adopted (adopt_groups): torch's name -> description.
        self.descriptions: dict[str, str] = {}


_state = _State()

# The name each kind of group carries in torch's errors, watchdog lines and flight recorder
# (Megatron-LM's names).
GROUP_DESCRIPTIONS = {
    "tensor": "TENSOR_MODEL_PARALLEL_GROUP",
    "data": "DATA_PARALLEL_GROUP",
    "pipeline": "PIPELINE_MODEL_PARALLEL_GROUP",
    "model": "MODEL_PARALLEL_GROUP",
    "embedding": "EMBEDDING_GROUP",
    "position_embedding": "POSITION_EMBEDDING_GROUP",
    "context": "CONTEXT_PARALLEL_GROUP",
    "data_context": "DATA_PARALLEL_GROUP_WITH_CP",
    "expert": "EXPERT_MODEL_PARALLEL_GROUP",
    "expert_data": "EXPERT_DATA_PARALLEL_GROUP",
}


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              *, context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              distributed_timeout_minutes: float = 30) -> None:
    """Create all process groups. Every rank must call this with the same sizes.

    Each group gets ``distributed_timeout_minutes`` (``--distributed-timeout-minutes``): a
    collective or point-to-point operation that waits longer fails instead of hanging; as in
    Megatron-LM, 30 minutes (torch's default) when not given.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before model parallel groups")
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel groups are already initialized")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    groups = build_rank_groups(world_size, tensor_model_parallel_size,
                               pipeline_model_parallel_size, context_parallel_size,
                               expert_model_parallel_size)
    _state.timeout = datetime.timedelta(minutes=distributed_timeout_minutes)

    def make(kind: str):
        # new_group is collective: every rank creates every group, in the same order.
        mine = None
        for ranks in getattr(groups, kind):
            group = new_group(ranks, GROUP_DESCRIPTIONS[kind])
            if rank in ranks:
                mine = group
        return mine

    _state.groups = groups
    _state.tensor = make("tensor")
    _state.data = make("data")
    _state.pipeline = make("pipeline")
    _state.model = make("model")
    _state.embedding = make("embedding")
    _state.position_embedding = make("position_embedding")
    # Groups of one are not made: only a context-parallel run asks for its context group.
    _state.context = make("context") if context_parallel_size > 1 else None
    # Without context parallelism the data x context groups are the data groups.
    _state.data_context = make("data_context") if context_parallel_size > 1 else _state.data
    # Without expert parallelism every rank holds all experts: the expert-data groups are the
    # data groups and there are no expert groups.
    if expert_model_parallel_size > 1:
        _state.expert, _state.expert_data = make("expert"), make("expert_data")
    else:
        _state.expert, _state.expert_data = None, _state.data
    _state.pipeline_ranks = groups.containing("pipeline", rank)
    _state.data_ranks = groups.containing("data", rank)
    _state.context_ranks = groups.containing("context", rank)
    _state.data_context_ranks = groups.containing("data_context", rank)
    _state.embedding_ranks = groups.containing("embedding", rank)
    _state.position_embedding_ranks = groups.containing("position_embedding", rank)
    if virtual_pipeline_model_parallel_size is not None:
        _state.virtual_pipeline_world_size = virtual_pipeline_model_parallel_size
        _state.virtual_pipeline_rank = 0


def new_group(ranks: Sequence[int], description: str):
    """A process group of ``ranks`` (collective: every rank calls it, in the same order) with
    the groups' timeout and ``description`` (the name torch's errors give it)."""
    # torch_xla replaces dist.new_group, once imported, by one without group_desc (2.9).
    named = {"group_desc": description} if _takes_group_desc(dist.new_group) else {}
    group = dist.new_group(list(ranks), timeout=_state.timeout, **named)
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        _state.members[group.group_name] = list(ranks)
    return group


def _takes_group_desc(new_group_fn) -> bool:
    try:
        return "group_desc" in inspect.signature(new_group_fn).parameters
    except (TypeError, ValueError):
        return False


def group_members(group_name: str) -> Optional[list[int]]:
    """The global ranks of a group made here (or of the default group), by torch's name for
    it; None for a group made elsewhere."""
    if group_name in _state.members:
        return list(_state.members[group_name])
    if dist.is_initialized() and group_name == dist.group.WORLD.group_name:
        return list(range(dist.get_world_size()))
    return None


def torch_group_names() -> set[str]:
    """torch's names of every process group this rank belongs to, wherever made."""
    return set(dist.distributed_c10d._world.pg_names.values()) if dist.is_initialized() else set()


def adopt_groups(names: set[str], owner: str) -> None:
    """Groups ``owner`` made (DeepSpeed's engine makes its own with torch's default timeout,
    30 minutes): give them the groups' timeout (``--distributed-timeout-minutes``) and
    remember their ranks and a description, so that a timeout in one is named like one in
    ours (megatron/core/timeouts.py)."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    for group, name in list(dist.distributed_c10d._world.pg_names.items()):
        if name not in names or name in _state.members:
            continue
        if set_timeout is not None and _state.timeout is not None:
            set_timeout(_state.timeout, group)
        _state.members[name] = dist.get_process_group_ranks(group)
        _state.descriptions[name] = f"{owner}'s group {name}"


def group_description(group_name: str) -> Optional[str]:
    """The description of an adopted group (None for others: theirs is torch's)."""
    return _state.descriptions.get(group_name)


def group_timeout() -> Optional[datetime.timedelta]:
    """The timeout the groups were made with (None before ``initialize_model_parallel``)."""
    return _state.timeout


def model_parallel_is_initialized() -> bool:
    return _state.groups is not None


def destroy_model_parallel() -> None:
    """Forget all groups and the recorded device (the torch.distributed default group is
    left alone)."""
    global _state
    _state = _State()
    set_default_device(None)


def _need(group):
    if group is None:
        raise RuntimeError("model parallel groups are not initialized")
    return group


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


# Groups. With no groups initialized, sizes are 1 and ranks 0 so a single process runs as is.
def get_tensor_model_parallel_group():
    return _need(_state.tensor)


def get_pipeline_model_parallel_group():
    return _need(_state.pipeline)


def get_data_parallel_group(with_context_parallel: bool = False):
    """The ranks that read different samples; ``with_context_parallel``: with the context-
    parallel ranks of each (the group gradients and optimizer shards are reduced over)."""
    return _need(_state.data_context if with_context_parallel else _state.data)


def get_context_parallel_group():
    return _need(_state.context)


def get_expert_model_parallel_group():
    """The ranks that share out one replica's experts (None without expert parallelism)."""
    return _state.expert


def get_expert_data_parallel_group():
    """The ranks holding the same experts, over which their gradients are reduced."""
    return _need(_state.expert_data)


def get_expert_model_parallel_world_size() -> int:
    return _size(_state.expert)


def get_expert_model_parallel_rank() -> int:
    return _rank(_state.expert)


def get_expert_data_parallel_world_size() -> int:
    return _size(_state.expert_data)


def get_model_parallel_group():
    return _need(_state.model)


def get_embedding_group():
    return _need(_state.embedding)


def get_position_embedding_group():
    return _need(_state.position_embedding)


def get_tensor_model_parallel_world_size() -> int:
    return _size(_state.tensor)


def get_tensor_model_parallel_rank() -> int:
    return _rank(_state.tensor)


def get_pipeline_model_parallel_world_size() -> int:
    return _size(_state.pipeline)


def get_pipeline_model_parallel_rank() -> int:
    return _rank(_state.pipeline)


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size(_state.data_context if with_context_parallel else _state.data)


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank(_state.data_context if with_context_parallel else _state.data)


def get_context_parallel_world_size() -> int:
    return _size(_state.context)


def get_context_parallel_rank() -> int:
    return _rank(_state.context)


def get_context_parallel_global_ranks() -> list[int]:
    return list(_state.context_ranks)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank in this rank's tensor-parallel group."""
    if _state.tensor is None:
        return 0
    return dist.get_rank() - get_tensor_model_parallel_rank()


def get_data_parallel_src_rank() -> int:
    return _state.data_ranks[0] if _state.data_ranks else 0


def get_data_parallel_group_ranks(with_context_parallel: bool = False) -> list[int]:
    return list(_state.data_context_ranks if with_context_parallel else _state.data_ranks)


def get_pipeline_model_parallel_first_rank() -> int:
    return _state.pipeline_ranks[0] if _state.pipeline_ranks else 0


def get_pipeline_model_parallel_last_rank() -> int:
    return _state.pipeline_ranks[-1] if _state.pipeline_ranks else 0


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _state.pipeline_ranks
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _state.pipeline_ranks
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _state.virtual_pipeline_world_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _state.virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _state.virtual_pipeline_rank = rank


def set_virtual_pipeline_model_parallel_world_size(size: Optional[int]) -> None:
    _state.virtual_pipeline_world_size = size


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first stage (and, unless ignore_virtual, the first virtual chunk)."""
    if not ignore_virtual and _state.virtual_pipeline_world_size is not None:
        if _state.virtual_pipeline_rank != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last stage (and, unless ignore_virtual, the last virtual chunk)."""
    vp = _state.virtual_pipeline_world_size
    if not ignore_virtual and vp is not None:
        if _state.virtual_pipeline_rank != vp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """True where this rank holds a copy of the word embeddings that must stay in sync."""
    if not dist.is_initialized() or not _state.embedding_ranks:
        return False
    rank = dist.get_rank()
    if rank not in _state.embedding_ranks:
        return False
    if ignore_virtual:
        return True
    if rank == _state.embedding_ranks[0]:
        return is_pipeline_first_stage()
    if rank == _state.embedding_ranks[-1]:
        return is_pipeline_last_stage()
    return True


def is_rank_in_position_embedding_group() -> bool:
    return dist.is_initialized() and dist.get_rank() in _state.position_embedding_ranks


_DEVICE: Optional[torch.device] = None  # set by set_default_device (megatron.assembly.initialize)
_CONTROL_GROUP: Optional[Any] = None  # set by set_control_group (megatron.assembly.initialize)


def set_default_device(device: Optional[torch.device]) -> None:
    """Record the device this process computes on (None: forget it)."""
    global _DEVICE
    _DEVICE = None if device is None else torch.device(device)


def get_default_device() -> torch.device:
    """The device this process computes on, where every tensor fed to a collective lives.

    What ``set_default_device`` recorded (``megatron.assembly.initialize`` decides it once per run);
    otherwise, for library use, this process's CUDA device under an NCCL default group (NCCL
    carries nothing else) and the CPU in every other case.
    """
    if _DEVICE is not None:
        return _DEVICE
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_control_group(group: Optional[Any]) -> None:
    """Record the group host values travel in, where it is not the default group (None:
    forget it)."""
    global _CONTROL_GROUP
    _CONTROL_GROUP = group


def get_control_group() -> Optional[Any]:
    """The group in which host values (flags, counts, timings, pickled objects, barriers)
    meet: None, the default group, except in an XLA run, whose default group is torch_xla's
    and carries XLA tensors only; there a gloo group of every rank (``megatron.platform.xla``)."""
    return _CONTROL_GROUP


def get_control_device() -> torch.device:
    """Where a host value (a flag, a count, a timing) meets the other ranks' in a collective
    whose result the host reads at once: the compute device, except on an XLA device, whose
    process group carries CPU tensors over gloo (an XLA tensor read on the host would run a
    graph of its own, outside the step)."""
    device = get_default_device()
    return torch.device("cpu") if device.type == "xla" else device

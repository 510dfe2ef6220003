"""Record every collective and point-to-point operation a rank issues through
``torch.distributed``, over any backend.

``Recorder.installed()`` replaces the ``torch.distributed`` functions below (in
``torch.distributed`` and in ``distributed_c10d``, where c10d's own helpers and
``P2POp`` look them up) with wrappers that append a ``CommOp`` and call the original. Only the
outermost call is recorded: ``broadcast_object_list`` is one operation, not the broadcasts it
is made of. The same recorder serves the rehearsal (fake backend) and a real gloo run, so their
records can be compared operation for operation.

Over the fake backend nothing is sent, and what a rank receives would be whatever its buffers
held: the recorder writes plausible values instead, so a rank's own code takes the path a real
run would take.

- received tensors (``recv``) are zeros; an all-gather fills every slot with this rank's input;
  a reduce-scatter keeps this rank's slice of its own input; a broadcast leaves the buffer;
  an all-to-all receives from every rank the piece this rank addresses to itself (alike ranks
  send each other what each sends itself: with the rehearsal's balanced expert routing, the
  exchanged token counts are exactly a real run's);
- small all-reduces (at most ``SMALL`` elements: the step's decisions, such as the fp16
  overflow flag, the NaN checks and the gradient norm) combine this rank's value with those
  of the ranks rehearsed before it in the same group and position (``SharedValues``), so
  every rank decides as the first ones did (the rehearsal runs the last pipeline stage
  first: it is where the loss and its overflow come from);
- object collectives (``broadcast_object_list``, ``all_gather_object``, ...) are not sent
  through the backend; receivers get the objects ranks rehearsed earlier gave, else keep
  their own.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron.planning.rehearsal.records import CommOp, SiteTable, new_group_detail

SMALL = 64  # elements: all-reduces up to this size carry decisions, not activations
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
# The checkout (megatron/planning/rehearsal/recorder.py is four levels down): call sites are
# shown relative to it.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE))))
_MODULES = (dist, c10d)


class SharedValues:
    """Values ranks rehearsed earlier contributed to small all-reduces and object
    collectives, by (group, position in the group's sequence of operations)."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, list[torch.Tensor]] = {}
        self.objects: dict[tuple, dict[int, Any]] = {}
        self.unknown_objects = 0  # receivers that had to keep their own object


class _TrackedWork:
    """An async request; remembers whether the rank waited for it."""

    def __init__(self, work: Any, op: CommOp, recorder: Recorder) -> None:
        self._work, self.op, self._recorder = work, op, recorder
        self.waited = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.waited = True
        self._recorder.close_p2p_batch()
        return self._work.wait(*args, **kwargs) if self._work is not None else True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Recorder:
    """Records one rank at a time (``rank_scope``); ``shared`` lives across ranks."""

    def __init__(self, shared: Optional[SharedValues] = None) -> None:
        self.shared = shared or SharedValues()
        self.sites = SiteTable()
        self.ops: list[CommOp] = []
        self.works: list[_TrackedWork] = []
        self.phase = "set-up"
        self.rank = 0
        self.fake = False
        self._positions: dict[tuple[int, ...], int] = {}
        self._depth = threading.local()
        self._batch = 0
        self._open_batch = 0
        self._group_ranks: dict[Any, tuple[int, ...]] = {}
        self.in_batch = False  # inside batch_isend_irecv

    # Scope ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def rank_scope(self) -> Iterator[Recorder]:
        """Record what this process's rank issues inside (the process group must exist)."""
        self.ops, self.works, self.phase = [], [], "set-up"
        self.rank, self.fake = dist.get_rank(), dist.get_backend() == "fake"
        self._positions, self._group_ranks = {}, {}
        self._batch = self._open_batch = 0
        yield self

    def unwaited(self) -> list[CommOp]:
        """Async operations this rank started and never waited for."""
        return [w.op for w in self.works if not w.waited]

    # Helpers used by the wrappers ----------------------------------------------------------

    def outermost(self) -> bool:
        return getattr(self._depth, "n", 0) == 0

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        self._depth.n = getattr(self._depth, "n", 0) + 1
        try:
            yield
        finally:
            self._depth.n -= 1

    def ranks(self, group: Any) -> tuple[int, ...]:
        if group is None or group is dist.GroupMember.WORLD:
            group = c10d._get_default_group()
        ranks = self._group_ranks.get(group)
        if ranks is None:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            self._group_ranks[group] = ranks
        return ranks

    def add(self, op: str, group: Any, tensor: Optional[torch.Tensor] = None, *,
            peer: Optional[int] = None, nbytes: Optional[int] = None, detail: str = "",
            p2p_batch: int = 0, splits: tuple = ()) -> CommOp:
        ranks = self.ranks(group)
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "object"
        if nbytes is None:
            nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        record = CommOp(op, ranks, peer, shape, dtype, nbytes, detail, self._site(),
                        self.phase, p2p_batch, splits)
        self.ops.append(record)
        if op not in ("send", "recv"):
            self.close_p2p_batch()
            self._positions[ranks] = self._positions.get(ranks, 0) + 1
        return record

    def position(self, group: Any) -> tuple:
        """(group, index) of the operation just recorded on ``group``."""
        ranks = self.ranks(group)
        return ranks, self._positions.get(ranks, 0)

    def track(self, work: Any, record: CommOp, async_op: bool) -> Any:
        if not async_op:
            return work
        tracked = _TrackedWork(work, record, self)
        self.works.append(tracked)
        return tracked

    def p2p_batch(self, batched: bool) -> int:
        """The batch number of a point-to-point operation posted now."""
        if batched:
            return self._batch
        if not self._open_batch:
            self._batch += 1
            self._open_batch = self._batch
        return self._open_batch

    def new_p2p_batch(self) -> int:
        self.close_p2p_batch()
        self._batch += 1
        return self._batch

    def close_p2p_batch(self) -> None:
        self._open_batch = 0

    def _site(self) -> str:
        frame = sys._getframe(3)
        frames = []
        while frame is not None and len(frames) < 3:
            rel = _shown_path(frame.f_code.co_filename)
            if rel is not None:
                frames.append(f"{rel}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return self.sites.intern(" < ".join(frames))

    # Fake-backend values -------------------------------------------------------------------

    def combine_small(self, tensor: torch.Tensor, op: Any, where: tuple) -> None:
        """This rank's small all-reduce result from its own value and earlier ranks'."""
        earlier = self.shared.tensors.setdefault(where, [])
        mine = tensor.detach().clone()
        if earlier and earlier[0].shape == tensor.shape:
            values = torch.stack([mine.to(earlier[0].dtype), *earlier])
            name = str(op).split(".")[-1].upper()
            if name == "MAX":
                combined = values.amax(0)
            elif name == "MIN":
                combined = values.amin(0)
            elif name in ("PRODUCT", "PROD"):
                combined = values.prod(0)
            else:
                combined = values.sum(0)
            with torch.no_grad():
                tensor.copy_(combined.to(tensor.dtype))
        earlier.append(mine)


@functools.cache
def _shown_path(path: str) -> Optional[str]:
    """A frame's file as a call site shows it (relative to the repository), or None for
    torch's own frames and the recorder's."""
    if path.startswith(_TORCH_DIR) or os.path.abspath(path) == _THIS_FILE \
            or path.endswith("contextlib.py"):
        return None
    return os.path.relpath(path, _REPO) if path.startswith(_REPO) else path


def _global(group: Any, rank: Optional[int], group_rank: Optional[int]) -> int:
    if rank is not None:
        return rank
    return dist.get_global_rank(group if group is not None else c10d._get_default_group(),
                                group_rank or 0)


def _reduce_name(op: Any) -> str:
    return str(op).split(".")[-1].upper()


def _fill_gathered(output: torch.Tensor, tensor: torch.Tensor) -> None:
    with torch.no_grad():
        n = output.numel() // max(tensor.numel(), 1)
        output.view(-1).copy_(tensor.reshape(-1).repeat(n))


# Wrappers -----------------------------------------------------------------------------------
# Each takes the original function and the recorder and returns the replacement. The
# signatures are torch.distributed's (keyword names included).


def _all_reduce(orig: Callable, rec: Recorder) -> Callable:
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not rec.outermost():
            return orig(tensor, op, group, async_op)
        record = rec.add("all_reduce", group, tensor, detail=_reduce_name(op))
        where = rec.position(group)
        with rec.nested():
            work = orig(tensor, op, group, async_op)
        if rec.fake and tensor.numel() <= SMALL:
            rec.combine_small(tensor, op, where)
        return rec.track(work, record, async_op)
    return all_reduce


def _all_gather_list(orig: Callable, rec: Recorder) -> Callable:
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not rec.outermost():
            return orig(tensor_list, tensor, group, async_op)
        record = rec.add("all_gather", group, tensor,
                         nbytes=sum(t.numel() * t.element_size() for t in tensor_list))
        with rec.nested():
            work = orig(tensor_list, tensor, group, async_op)
        if rec.fake:
            with torch.no_grad():
                for t in tensor_list:
                    t.copy_(tensor)
        return rec.track(work, record, async_op)
    return all_gather


def _all_gather_flat(name: str) -> Callable:
    def wrap(orig: Callable, rec: Recorder) -> Callable:
        def all_gather_flat(output_tensor, input_tensor, group=None, async_op=False):
            if not rec.outermost():
                return orig(output_tensor, input_tensor, group, async_op)
            record = rec.add("all_gather_into_tensor", group, input_tensor,
                             nbytes=output_tensor.numel() * output_tensor.element_size())
            with rec.nested():
                work = orig(output_tensor, input_tensor, group, async_op)
            if rec.fake:
                _fill_gathered(output_tensor, input_tensor)
            return rec.track(work, record, async_op)
        all_gather_flat.__name__ = name
        return all_gather_flat
    return wrap


def _reduce_scatter_flat(name: str) -> Callable:
    def wrap(orig: Callable, rec: Recorder) -> Callable:
        def reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=None,
                                async_op=False):
            if not rec.outermost():
                return orig(output, input, op, group, async_op)
            record = rec.add("reduce_scatter_tensor", group, input, detail=_reduce_name(op))
            with rec.nested():
                work = orig(output, input, op, group, async_op)
            if rec.fake:
                me = dist.get_rank(group) if group is not None else dist.get_rank()
                with torch.no_grad():
                    output.view(-1).copy_(input.reshape(-1)[me * output.numel():
                                                            (me + 1) * output.numel()])
            return rec.track(work, record, async_op)
        reduce_scatter_flat.__name__ = name
        return reduce_scatter_flat
    return wrap


def _reduce_scatter_list(orig: Callable, rec: Recorder) -> Callable:
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not rec.outermost():
            return orig(output, input_list, op, group, async_op)
        record = rec.add("reduce_scatter", group, output, detail=_reduce_name(op),
                         nbytes=sum(t.numel() * t.element_size() for t in input_list))
        with rec.nested():
            work = orig(output, input_list, op, group, async_op)
        if rec.fake:
            me = dist.get_rank(group) if group is not None else dist.get_rank()
            with torch.no_grad():
                output.copy_(input_list[me])
        return rec.track(work, record, async_op)
    return reduce_scatter


def _broadcast(orig: Callable, rec: Recorder) -> Callable:
    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        if not rec.outermost():
            return orig(tensor, src, group, async_op, group_src)
        record = rec.add("broadcast", group, tensor, peer=_global(group, src, group_src))
        with rec.nested():
            work = orig(tensor, src, group, async_op, group_src)
        return rec.track(work, record, async_op)
    return broadcast


def _reduce(orig: Callable, rec: Recorder) -> Callable:
    def reduce(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False,
               group_dst=None):
        if not rec.outermost():
            return orig(tensor, dst, op, group, async_op, group_dst)
        record = rec.add("reduce", group, tensor, peer=_global(group, dst, group_dst),
                         detail=_reduce_name(op))
        with rec.nested():
            work = orig(tensor, dst, op, group, async_op, group_dst)
        return rec.track(work, record, async_op)
    return reduce


def _barrier(orig: Callable, rec: Recorder) -> Callable:
    def barrier(group=dist.GroupMember.WORLD, async_op=False, device_ids=None, timeout=None):
        if not rec.outermost():
            return orig(group, async_op, device_ids, timeout)
        record = rec.add("barrier", group)
        with rec.nested():
            work = orig(group, async_op, device_ids, timeout)
        return rec.track(work, record, async_op)
    return barrier


def _point_to_point(name: str, sends: bool, async_op: bool) -> Callable:
    peer_name = "dst" if sends else "src"

    def wrap(orig: Callable, rec: Recorder) -> Callable:
        def p2p(*args, **kwargs):
            if not rec.outermost():
                return orig(*args, **kwargs)
            bound = dict(zip(("tensor", peer_name, "group", "tag", f"group_{peer_name}"), args))
            bound.update(kwargs)
            tensor, group, tag = bound["tensor"], bound.get("group"), bound.get("tag", 0)
            peer = _global(group, bound.get(peer_name), bound.get(f"group_{peer_name}"))
            batch = rec.p2p_batch(batched=rec.in_batch) if async_op else rec.new_p2p_batch()
            record = rec.add("send" if sends else "recv", group, tensor, peer=peer,
                             detail=f"tag {tag}", p2p_batch=batch)
            with rec.nested():
                result = orig(*args, **kwargs)
            if rec.fake and not sends:
                with torch.no_grad():
                    tensor.zero_()
            return rec.track(result, record, True) if async_op and not rec.in_batch else result
        p2p.__name__ = name
        return p2p
    return wrap


def _batch_isend_irecv(orig: Callable, rec: Recorder) -> Callable:
    def batch_isend_irecv(p2p_op_list):
        if not rec.outermost():
            return orig(p2p_op_list)
        rec.new_p2p_batch()
        rec.in_batch = True
        try:
            works = orig(p2p_op_list)  # each isend/irecv inside is recorded
        finally:
            rec.in_batch = False
        first = rec.ops[-len(p2p_op_list)] if p2p_op_list else None
        return [rec.track(w, first, True) for w in works]
    return batch_isend_irecv


def _object_collective(name: str) -> Callable:
    """``broadcast_object_list``, ``all_gather_object``, ``gather_object``: recorded as one
    operation; over the fake backend their objects come from ``SharedValues``."""
    def wrap(orig: Callable, rec: Recorder) -> Callable:
        def objects(*args, **kwargs):
            if not rec.outermost():
                return orig(*args, **kwargs)
            bound = _OBJECT_SIGNATURES[name](*args, **kwargs)
            group = bound.get("group")
            root = None
            if name != "all_gather_object":
                key = "src" if name == "broadcast_object_list" else "dst"
                root = _global(group, bound.get(key), bound.get(f"group_{key}"))
            rec.add(name, group, peer=root)
            where = rec.position(group)
            if not rec.fake:
                with rec.nested():
                    return orig(*args, **kwargs)
            _fake_objects(name, bound, root, where, rec)
            return None
        objects.__name__ = name
        return objects
    return wrap


def _bind(*names: str, defaults: dict) -> Callable[..., dict]:
    def bind(*args, **kwargs) -> dict:
        out = dict(defaults)
        out.update(zip(names, args))
        out.update(kwargs)
        return out
    return bind


_OBJECT_SIGNATURES = {
    "broadcast_object_list": _bind("object_list", "src", "group", "device", "group_src",
                                   defaults={"src": None, "group": None, "group_src": None}),
    "all_gather_object": _bind("object_list", "obj", "group", defaults={"group": None}),
    "gather_object": _bind("obj", "object_gather_list", "dst", "group", "group_dst",
                           defaults={"object_gather_list": None, "dst": None, "group": None,
                                     "group_dst": None}),
}


def _fake_objects(name: str, bound: dict, root: Optional[int], where: tuple,
                  rec: Recorder) -> None:
    shared = rec.shared.objects.setdefault(where, {})
    me = rec.rank
    if name == "broadcast_object_list":
        objects = bound["object_list"]
        if me == root:
            shared[me] = list(objects)
        elif root in shared:
            objects[:] = shared[root]
        else:
            rec.shared.unknown_objects += 1
        return
    mine = bound["obj"]
    shared[me] = mine
    ranks = where[0]
    out = bound["object_list"] if name == "all_gather_object" else \
        bound.get("object_gather_list")
    if out is None:
        return
    for i, r in enumerate(ranks):
        out[i] = shared.get(r, mine)


def _new_group(orig: Callable, rec: Recorder) -> Callable:
    def new_group(ranks=None, *args, **kwargs):
        if not rec.outermost():
            return orig(ranks, *args, **kwargs)
        members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
        rec.add("new_group", None, detail=new_group_detail(members))
        with rec.nested():
            return orig(ranks, *args, **kwargs)
    return new_group


# name -> (wrapper factory)
def _all_to_all_single(orig: Callable, rec: Recorder) -> Callable:
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        args = (output, input, output_split_sizes, input_split_sizes, group, async_op)
        if not rec.outermost():
            return orig(*args)
        splits = ((tuple(input_split_sizes), tuple(output_split_sizes))
                  if input_split_sizes is not None and output_split_sizes is not None else ())
        record = rec.add("all_to_all_single", group, input, splits=splits)
        with rec.nested():
            work = orig(*args)
        if rec.fake:
            _fill_all_to_all(output, input, output_split_sizes, input_split_sizes, group)
        return rec.track(work, record, async_op)
    return all_to_all_single


def _fill_all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits, input_splits,
                     group: Any) -> None:
    """Every piece of ``output`` from this rank's piece for itself (repeated or cut to the
    piece's size; zeros where it has none)."""
    n = dist.get_world_size(group) if group is not None else dist.get_world_size()
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    rows_in = list(input_splits) if input_splits else [input.size(0) // n] * n
    rows_out = list(output_splits) if output_splits else [output.size(0) // n] * n
    start = sum(rows_in[:me])
    own = input[start:start + rows_in[me]]
    with torch.no_grad():
        if own.size(0) == 0:
            output.zero_()
            return
        pieces = [own[torch.arange(rows, device=own.device) % own.size(0)] for rows in rows_out]
        output.copy_(torch.cat(pieces).view_as(output))


_WRAPPERS = {
    "all_to_all_single": _all_to_all_single,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather_list,
    "all_gather_into_tensor": _all_gather_flat("all_gather_into_tensor"),
    "all_gather_single": _all_gather_flat("all_gather_single"),
    "_all_gather_base": _all_gather_flat("_all_gather_base"),
    "reduce_scatter_tensor": _reduce_scatter_flat("reduce_scatter_tensor"),
    "reduce_scatter_single": _reduce_scatter_flat("reduce_scatter_single"),
    "_reduce_scatter_base": _reduce_scatter_flat("_reduce_scatter_base"),
    "reduce_scatter": _reduce_scatter_list,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "barrier": _barrier,
    "send": _point_to_point("send", sends=True, async_op=False),
    "recv": _point_to_point("recv", sends=False, async_op=False),
    "isend": _point_to_point("isend", sends=True, async_op=True),
    "irecv": _point_to_point("irecv", sends=False, async_op=True),
    "batch_isend_irecv": _batch_isend_irecv,
    "broadcast_object_list": _object_collective("broadcast_object_list"),
    "all_gather_object": _object_collective("all_gather_object"),
    "gather_object": _object_collective("gather_object"),
    "new_group": _new_group,
}


@contextlib.contextmanager
def installed(recorder: Recorder) -> Iterator[Recorder]:
    """``recorder`` receives every operation issued inside (all threads of this process)."""
    saved = []
    for name, factory in _WRAPPERS.items():
        original = getattr(c10d, name, None)
        if original is None:  # an older torch without this name
            continue
        wrapper = factory(original, recorder)
        for module in _MODULES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
    try:
        yield recorder
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)

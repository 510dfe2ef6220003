"""Contiguous gradient (and parameter) storage split into communication buckets.

One ``ParamAndGradBuffer`` holds the gradients of every parameter that shares a
(param dtype, grad dtype) pair as views into one flat tensor, so a whole bucket is reduced
with a single collective. Parameters are laid out in reverse order of registration, the
order in which backward usually produces their gradients, so the first bucket fills first.

For the distributed optimizer each bucket is padded to a multiple of the data-parallel size
and data-parallel rank ``r`` owns the ``r``-th equal, contiguous slice of every bucket
(``Bucket.shard_range``); parameters then also live in a flat buffer of their own dtype with
the same layout, so updated shards are all-gathered bucket by bucket in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core.collectives import all_gather_flat, reduce_scatter_flat


@dataclass(eq=False)
class Bucket:
    """A contiguous range ``[start, end)`` of a buffer, reduced by one collective.

    ``deferred`` buckets are never launched from a backward hook, only by
    ``finish_grad_sync``, so their gradients can be combined with other groups first.
    """

    params: list[torch.nn.Parameter]
    start: int
    end: int
    deferred: bool = False
    ready: set = field(default_factory=set)
    handle: Optional[Any] = None
    launched: bool = False
    scattered: Optional[torch.Tensor] = None  # reduce-scatter output until it is copied back

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """The buffer range ``[lo, hi)`` that data-parallel rank ``dp_rank`` owns."""
        size = self.numel // dp_size
        lo = self.start + dp_rank * size
        return lo, lo + size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ParamAndGradBuffer:
    """Flat gradient storage (and, for sharding, flat parameter storage) for ``params``.

    After construction every parameter has ``param.main_grad``, a view of shape
    ``param.shape`` into ``grad_data``; with ``shard_over_dp`` the parameter's data is also
    moved into ``param_data`` (same layout, the parameter's dtype).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], grad_dtype: torch.dtype,
                 bucket_size: Optional[int], dp_group: Any, dp_size: int,
                 shard_over_dp: bool = False, isolate: Sequence[torch.nn.Parameter] = (),
                 grad_scale: Optional[float] = None) -> None:
        if not params:
            raise ValueError("a gradient buffer needs at least one parameter")
        self.params = list(params)
        self.param_dtype = self.params[0].dtype
        self.grad_dtype = grad_dtype
        self.dp_group = dp_group
        self.dp_size = dp_size
        # What the summed gradients are multiplied by: 1 / dp_size (an average), or for
        # experts under expert parallelism 1 / the whole data-parallel size, since their
        # gradients already hold the tokens of the expert group's ranks.
        self.grad_scale = 1.0 / dp_size if grad_scale is None else grad_scale
        self.shard_over_dp = shard_over_dp
        self.param_index: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        self._layout(bucket_size, {id(p) for p in isolate})
        device = self.params[0].device
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if shard_over_dp:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        self._bind_views()

    def _layout(self, bucket_size: Optional[int], isolate: set[int]) -> None:
        """Assign each parameter its ``[start, end)`` and cut the buffer into buckets."""
        offset, current = 0, []

        def close(deferred: bool = False) -> None:
            nonlocal offset, current
            if not current:
                return
            start = self.param_index[current[0]][0]
            end = _round_up(offset, self.dp_size) if self.shard_over_dp else offset
            self.buckets.append(Bucket(current, start, end, deferred))
            offset, current = end, []

        for p in self.params:
            if id(p) in isolate:
                close()
            self.param_index[p] = (offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            if id(p) in isolate:
                close(deferred=True)
            elif bucket_size is not None and offset - self.param_index[current[0]][0] >= bucket_size:
                close()
        close()
        self.numel = offset

    def _bind_views(self) -> None:
        for p in self.params:
            start, end = self.param_index[p]
            p.main_grad = self.grad_data[start:end].view(p.shape)
            if self.param_data is not None:
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view

    def zero(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.handle, bucket.launched, bucket.scattered = None, False, None

    # Communication -------------------------------------------------------------------------

    def launch(self, bucket: Bucket, async_op: bool) -> None:
        """Average the bucket's gradients over data parallel: all-reduce or reduce-scatter."""
        bucket.launched = True
        data = self.grad_data[bucket.start:bucket.end]
        # Scale first and sum afterwards: gloo has no AVG, and a pre-scaled sum of fp16
        # gradients is less likely to overflow.
        if self.grad_scale != 1.0:
            data.mul_(self.grad_scale)
        if self.dp_size == 1:
            return
        if self.shard_over_dp:
            # A separate output: gloo does not promise in-place reduce-scatter.
            bucket.scattered = torch.empty(bucket.numel // self.dp_size, dtype=data.dtype,
                                           device=data.device)
            bucket.handle = reduce_scatter_flat(bucket.scattered, data, self.dp_group,
                                                async_op=async_op)
        else:
            bucket.handle = dist.all_reduce(data, group=self.dp_group, async_op=async_op)

    def finish(self) -> None:
        """Launch buckets not launched yet (in order, the same on every rank), then wait."""
        for bucket in self.buckets:
            if not bucket.launched:
                self.launch(bucket, async_op=False)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            if bucket.scattered is not None:
                lo, hi = bucket.shard_range(dist.get_rank(self.dp_group), self.dp_size)
                self.grad_data[lo:hi].copy_(bucket.scattered)
            bucket.handle, bucket.launched, bucket.scattered = None, False, None
            bucket.ready.clear()

    def all_gather_params(self) -> None:
        """Every rank's updated shard of ``param_data`` -> the full ``param_data`` everywhere."""
        if self.param_data is None or self.dp_size == 1:
            return
        rank = dist.get_rank(self.dp_group)
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(rank, self.dp_size)
            # The input is cloned because gloo does not promise in-place all-gather.
            all_gather_flat(self.param_data[bucket.start:bucket.end],
                            self.param_data[lo:hi].clone(), self.dp_group)

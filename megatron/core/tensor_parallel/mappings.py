"""Collectives across the tensor-parallel group, as autograd functions.

Three layers: private ops that do one collective, autograd pairs whose backward is the
conjugate collective, and one-line public wrappers that take an optional group (default: this
rank's tensor-parallel group). With a group of size 1 every op is the identity.

Tensor layout: the last dim is the hidden/feature dim; the first dim is the sequence dim used
by sequence parallelism ([s, b, h]).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collectives import all_gather_flat, reduce_scatter_flat


def _group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    if group is not None:
        return group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    chunk = x.size(-1) // world
    return x.narrow(-1, dist.get_rank(group) * chunk, chunk).contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    chunk = x.size(0) // world
    return x.narrow(0, dist.get_rank(group) * chunk, chunk).contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    out = torch.empty((x.size(0) * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    out = torch.empty((x.size(0) // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x.contiguous(), group)
    return out


def tensor_parallel_group(group: Optional[dist.ProcessGroup] = None):
    """``group``, or this rank's tensor-parallel group (None before there is one)."""
    return _group(group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from each rank's ``[s/t, ...]`` part (no autograd: for autograd
    functions that do their own backward, such as the sequence-parallel linear layer)."""
    return _gather_first_dim(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's ``[s/t, ...]`` part of the sum of every rank's ``x`` (no autograd)."""
    return _reduce_scatter_first_dim(x, group)


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (each rank's branch contributes a partial grad)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce partial sums. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: gather it back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: gather slices along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence. Backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all-gather the sequence. Backward: reduce-scatter (when the consumer is
    tensor-parallel, each rank holds a partial grad) or split (when it is replicated)."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Forward: reduce-scatter partial sums along the sequence. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToRegion.apply(x, _group(group))


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, _group(group))


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ScatterToRegion.apply(x, _group(group))


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromRegion.apply(x, _group(group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ScatterToSequenceRegion.apply(x, _group(group))


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    return _GatherFromSequenceRegion.apply(x, _group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceScatterToSequenceRegion.apply(x, _group(group))

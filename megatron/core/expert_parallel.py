"""Moving tokens to the ranks that hold their experts and back (expert parallelism).

Each function is differentiable: the backward pass of a move is the move the other way
(all-to-all with the splits swapped; all-gather <-> reduce-scatter), so gradients reach the
tokens' own ranks and the routing probabilities stay on the rank that computed them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.collectives import all_gather_flat, reduce_scatter_flat


def _all_to_all(x: torch.Tensor, group: Any, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (input_splits, output_splits)
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        back_out, back_in = ctx.splits
        return _all_to_all(grad, ctx.group, back_out, back_in), None, None, None


def all_to_all(x: torch.Tensor, group: Any, output_splits: list[int],
               input_splits: list[int]) -> torch.Tensor:
    """Rows ``x[sum(input_splits[:r]) : ...+input_splits[r]]`` go to rank ``r`` of ``group``;
    the result holds what each rank sent here, in rank order (``output_splits`` rows each)."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """``counts`` ``[ranks, n]`` (row ``r``: what this rank sends rank ``r``) -> the same
    shape holding, in row ``r``, what rank ``r`` sends here. Not differentiable."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.new_empty((x.size(0) * dist.get_world_size(group),) + tuple(x.shape[1:]))
    all_gather_flat(out, x.contiguous(), group)
    return out


def _reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.new_empty((x.size(0) // dist.get_world_size(group),) + tuple(x.shape[1:]))
    reduce_scatter_flat(out, x.contiguous(), group)
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0 in rank order (backward: the sum of the
    gradients of this rank's rows, from every rank)."""
    if not x.requires_grad:
        return _gather(x, group)
    return _Gather.apply(x, group)


def reduce_scatter_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's block of rows (rank order along dim 0) of the sum of every rank's ``x``."""
    return _ReduceScatter.apply(x, group)

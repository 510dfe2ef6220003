"""Global gradient norm, clipping and zero counting across model-parallel ranks.

A model replica is spread over tensor- and pipeline-parallel ranks, so the norm of its gradient
is a sum of per-rank partial sums. Each parameter must count exactly once: tensor-parallel
shards count on every rank, replicated parameters only on tensor rank 0
(``param_is_not_tensor_parallel_duplicate``), and the second copy of a tied weight
(``param.shared``) not at all. With the distributed optimizer each data-parallel rank holds a
disjoint shard of the main parameters, so the sum also runs over the data-parallel group:
pass both groups.

``groups`` arguments accept one process group, a sequence of groups (reduced one after the
other, which sums over their product), or None (no reduction: a single process).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import param_is_not_shared, param_is_not_tensor_parallel_duplicate

Groups = Union[None, Any, Sequence[Any]]


def _as_group_list(groups: Groups) -> list:
    if groups is None:
        return []
    if isinstance(groups, (list, tuple)):
        return [g for g in groups if g is not None]
    return [groups]


def all_reduce_over(tensor: torch.Tensor, groups: Groups,
                    op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``tensor`` in place over each group in turn (a no-op without torch.distributed)."""
    if not dist.is_initialized():
        return tensor
    for group in _as_group_list(groups):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def counted_params(parameters: Iterable[torch.Tensor], with_grad: bool = True
                   ) -> list[torch.Tensor]:
    """The parameters that count towards norms on this rank (see the module docstring);
    ``with_grad``: only those with a gradient."""
    return [p for p in parameters if (p.grad is not None or not with_grad)
            and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]


def grads_for_norm(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients that count towards the norm on this rank (see the module docstring)."""
    return [p.grad for p in counted_params(parameters)]


_NORM_CHUNK = 1024


def _chunked_norm_power(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |g|^p`` in fp64 from fp32 norms of runs of ``_NORM_CHUNK`` elements."""
    flat = grad.reshape(-1).float()
    whole = flat.numel() - flat.numel() % _NORM_CHUNK
    parts = [torch.linalg.vector_norm(flat[whole:], norm_type).reshape(1)]
    if whole:
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), norm_type,
                                              dim=1))
    return torch.cat(parts).double().pow(norm_type).sum()


def get_grad_norm_fp32(grads: Sequence[torch.Tensor], groups: Groups = None,
                       norm_type: float = 2.0, *, experts: Sequence[torch.Tensor] = (),
                       expert_groups: Groups = None) -> float:
    """The norm of all ``grads`` of every rank in ``groups``, computed in fp32 (``experts``:
    see ``grad_norm_on_device``)."""
    return float(grad_norm_on_device(grads, groups, norm_type, experts=experts,
                                     expert_groups=expert_groups))


def grad_norm_on_device(grads: Sequence[torch.Tensor], groups: Groups = None,
                        norm_type: float = 2.0, *, experts: Sequence[torch.Tensor] = (),
                        expert_groups: Groups = None) -> torch.Tensor:
    """``get_grad_norm_fp32`` as a 1-element tensor on the compute device, read by no one
    (an XLA step keeps it in its graph). ``experts``: gradients that also differ over
    ``expert_groups`` (experts shared out by expert parallelism); their part is summed there
    first."""
    norm_type = float(norm_type)
    total = _local_power(grads, norm_type)
    if experts:
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        expert_part = all_reduce_over(_local_power(experts, norm_type), expert_groups, op)
        total = (torch.maximum(total, expert_part) if norm_type == math.inf
                 else total + expert_part)
    if norm_type == math.inf:
        all_reduce_over(total, groups, dist.ReduceOp.MAX)
        return total
    all_reduce_over(total, groups)
    return total.pow(1.0 / norm_type)


def _local_power(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This rank's ``sum |g|^p`` over ``grads`` (their maximum for the inf-norm), a
    1-element tensor on the collectives' device."""
    device = parallel_state.get_default_device()  # what the collective can carry
    if norm_type == math.inf:
        if grads:
            return torch.stack([g.detach().abs().max().float() for g in grads]).max(
                ).reshape(1).to(device)
        return torch.zeros(1, device=device)
    # On CUDA the fp32 reduction is a tree and accurate. The CPU kernel accumulates long
    # runs in fp32 (a 38M-element embedding's norm came out 3e-3 low), and how a tensor is
    # split over tensor ranks changes the rounding: there each run of _NORM_CHUNK elements is
    # reduced in fp32 and the runs are summed in fp64 (within 1e-8 of an fp64 norm, 20x
    # faster than converting the gradient to fp64).
    on_cpu = not grads or grads[0].device.type == "cpu"
    total = torch.zeros(1, dtype=torch.float64 if on_cpu else torch.float32, device=device)
    if grads:
        if on_cpu:
            powers = [_chunked_norm_power(g.detach(), norm_type) for g in grads]
        else:
            powers = [n.pow(norm_type) for n in
                      torch._foreach_norm([g.detach().float() for g in grads], norm_type)]
        total += torch.stack(powers).to(device=device, dtype=total.dtype).sum()
    return total


def clip_grads_by_norm_on_device(parameters: Iterable[torch.Tensor], max_norm: float,
                                 total_norm: torch.Tensor) -> None:
    """``clip_grads_by_total_norm`` with the norm a device tensor: every gradient is scaled
    by ``min(1, max_norm / (total_norm + 1e-6))`` in the graph, so no host read decides."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if grads:
        coeff = (max_norm / (total_norm.float() + 1.0e-6)).clamp(max=1.0).reshape(())
        torch._foreach_mul_(grads, coeff.to(grads[0].dtype))


def clip_grads_by_total_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                             total_norm: float) -> None:
    """Scale every gradient by ``max_norm / (total_norm + 1e-6)`` if that is below one."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        grads = [p.grad.detach() for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm_fp32(parameters: Iterable[torch.Tensor], max_norm: float,
                        model_parallel_group: Groups = None, norm_type: float = 2.0) -> float:
    """Clip the gradients of ``parameters`` to a global norm of ``max_norm``.

    The norm counts each parameter of the model once across the ranks in
    ``model_parallel_group`` (a group or a sequence of groups; see the module docstring).
    Every gradient is scaled, the norm only reads the ones that count. Returns the total norm
    before clipping.
    """
    parameters = list(parameters)
    total_norm = get_grad_norm_fp32(grads_for_norm(parameters), model_parallel_group, norm_type)
    if max_norm > 0.0:
        clip_grads_by_total_norm(parameters, max_norm, total_norm)
    return total_norm


def count_zeros_fp32(parameters: Iterable[torch.Tensor], model_parallel_group: Groups = None,
                     *, experts: Iterable[torch.Tensor] = (), expert_groups: Groups = None) -> int:
    """The number of exactly-zero gradient entries, counted like the norm (each param once;
    ``experts``: parameters that also differ over ``expert_groups``)."""
    device = parallel_state.get_default_device()  # what the collective can carry

    def zeros(params: Iterable[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads_for_norm(params):
            total += (g.detach() == 0).sum().to(device)
        return total

    total = zeros(parameters)
    experts = list(experts)
    if experts:
        total += all_reduce_over(zeros(experts), expert_groups)
    all_reduce_over(total, model_parallel_group)
    return int(total.item())

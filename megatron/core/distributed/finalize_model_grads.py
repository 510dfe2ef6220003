"""Everything that happens to gradients between the last backward and the optimizer step.

1. The word-embedding weight that the first and last pipeline stage share (tied input
   embedding and output layer) gets the sum of both stages' gradients (embedding group).
2. Each chunk's gradients are averaged over data parallel (``finish_grad_sync``).
3. Under sequence parallelism, LayerNorm parameters (``param.sequence_parallel``) saw only this
   tensor rank's part of the sequence: their gradients are summed over the tensor group.

Step 1 runs on the local, not yet averaged, gradients: the two stages lay out their buffers
differently, so with the distributed optimizer their owned shards of the shared weight need
not line up after averaging. Summing first and averaging after gives the same result for
plain all-reduce too, since both are linear. Data-parallel wrappers keep that weight's
bucket back for exactly this (see ``distributed_data_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will read: ``main_grad`` under the DDP wrapper, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def allreduce_embedding_grads(model_chunks: Sequence[nn.Module]) -> None:
    """Sum the shared word-embedding gradient over the first and last pipeline stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        chunk = model_chunks[-1]
    else:
        chunk = model_chunks[0]
    model = unwrap_model(chunk)
    if not getattr(model, "share_embeddings_and_output_weights", True):
        return  # untied: every stage of the group knows it, none waits for the other
    getter = getattr(model, "shared_embedding_or_output_weight", None)
    weight = getter() if callable(getter) else None
    if weight is None:
        return
    grad = _grad_of(weight)
    if grad is None:
        # The peer stage is waiting in the same all-reduce: contribute zeros, never skip.
        weight.grad = grad = torch.zeros_like(weight)
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())


def allreduce_sequence_parallel_grads(model_chunks: Sequence[nn.Module]) -> None:
    """Sum gradients of ``sequence_parallel`` parameters over the tensor-parallel group."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = []
    for chunk in model_chunks:
        for param in unwrap_model(chunk).parameters():
            grad = _grad_of(param)
            if param.requires_grad and getattr(param, "sequence_parallel", False) and grad is not None:
                grads.append(grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        _all_reduce_coalesced(same_dtype, parallel_state.get_tensor_model_parallel_group())


def finalize_model_grads(model_chunks: Sequence[nn.Module]) -> None:
    """Make every chunk's gradients final: embedding sum, data-parallel average, SP sum."""
    allreduce_embedding_grads(model_chunks)
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if callable(finish):
            finish()
    allreduce_sequence_parallel_grads(model_chunks)

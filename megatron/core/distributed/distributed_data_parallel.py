"""Data-parallel wrapper: gradients accumulate in contiguous buffers and are averaged once.

Each parameter gets ``param.main_grad``, a view into a flat buffer (one per
(param dtype, grad dtype) pair). A hook that runs after autograd has accumulated
``param.grad`` adds it into ``main_grad`` and frees ``param.grad``, so gradients of successive
micro-batches sum in the buffer (in fp32 with ``accumulate_allreduce_grads_in_fp32``).
Layers that can add a weight gradient into ``main_grad`` themselves do so (gradient-
accumulation fusion, ``megatron/core/grad_accumulation.py``; ``gradient_accumulation_fusion=
False`` turns it off); the hook then skips what autograd hands it for those weights.
``finish_grad_sync()`` averages the buffers over the data-parallel group: an all-reduce, or a
reduce-scatter when the distributed optimizer owns one shard per rank.

With ``overlap_grad_reduce`` the buffer is cut into buckets and a bucket's reduction starts,
asynchronously, as soon as every parameter in it has its gradient for the last micro-batch;
earlier micro-batches run inside ``no_sync()``. Under pipeline parallelism the word-embedding
weight shared by the first and last stage (``module.shared_embedding_or_output_weight()``) is
kept in a bucket of its own that only ``finish_grad_sync`` launches, so ``finalize_model_grads`` can first add the other stage's
gradient to it (that order is what keeps the distributed optimizer's shards right).

Typical step::

    model.zero_grad_buffer(); optimizer.zero_grad()
    for i, batch in enumerate(micro_batches):
        with (model.no_sync() if i < len(micro_batches) - 1 else nullcontext()):
            (loss_fn(model(batch)) / len(micro_batches)).backward()
    finalize_model_grads([model])
    optimizer.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.core.grad_accumulation import grad_already_added, mark_for_fusion

# Megatron's default bucket when overlapping: large enough to keep the links busy.
_DEFAULT_OVERLAP_BUCKET_SIZE = 40_000_000


def default_data_parallel_group() -> Optional[Any]:
    """The data-parallel group from parallel_state (with the context-parallel ranks, which
    hold the same weights), else the world group, else None."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.is_initialized():
        return dist.group.WORLD
    return None


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to experts shared out by expert parallelism (megatron-core's
    ``allreduce = False`` mark): it differs across the expert group's ranks."""
    return not getattr(param, "allreduce", True)


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; ``module`` is the wrapped model and forward passes through."""

    def __init__(self, module: nn.Module, *, data_parallel_group: Optional[Any] = None,
                 accumulate_allreduce_grads_in_fp32: bool = True,
                 overlap_grad_reduce: bool = False, use_distributed_optimizer: bool = False,
                 bucket_size: Optional[int] = None, average_gradients: bool = True,
                 gradient_accumulation_fusion: bool = True) -> None:
        super().__init__()
        self.module = module
        if data_parallel_group is None:
            data_parallel_group = default_data_parallel_group()
        self.data_parallel_group = group = data_parallel_group
        self.data_parallel_size = dist.get_world_size(group) if group is not None else 1
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        if bucket_size is None and overlap_grad_reduce:
            bucket_size = max(_DEFAULT_OVERLAP_BUCKET_SIZE, 1_000_000 * self.data_parallel_size)
        self.bucket_size = bucket_size
        self.is_last_microbatch = True
        # False under --dp-mode decentralized: each replica keeps its own gradients, and the
        # optimizer averages parameters with neighbours instead (core/optimizer/decentralized).
        self.average_gradients = average_gradients

        self.buffers: list[ParamAndGradBuffer] = []
        self._bucket_of: dict[nn.Parameter, Any] = {}
        self._buffer_of: dict[nn.Parameter, ParamAndGradBuffer] = {}
        self._build_buffers()
        # Layers may add weight gradients into main_grad themselves (core/grad_accumulation).
        for buffer in self.buffers:
            mark_for_fusion(buffer.params, buffer.grad_dtype, gradient_accumulation_fusion)
        for param in self._buffer_of:
            param.register_post_accumulate_grad_hook(self._accumulate_hook)

    # Construction ----------------------------------------------------------------------------

    def _deferred_params(self) -> list[nn.Parameter]:
        """Parameters whose bucket must wait for finalize_model_grads (see module docstring)."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return []
        getter = getattr(self.module, "shared_embedding_or_output_weight", None)
        weight = getter() if callable(getter) else None
        return [weight] if weight is not None and weight.requires_grad else []

    def _reduction_of(self, expert: bool) -> tuple[Any, int, Optional[float]]:
        """(group, its size, gradient scale) of dense parameters, or of the experts of
        expert parallelism: summed over the ranks holding the same experts and divided by the
        whole data-parallel size, as megatron-core does."""
        if not self.average_gradients:
            return self.data_parallel_group, 1, None
        if not expert:
            return self.data_parallel_group, self.data_parallel_size, None
        group = parallel_state.get_expert_data_parallel_group()
        return group, dist.get_world_size(group), 1.0 / self.data_parallel_size

    def _build_buffers(self) -> None:
        # Reverse registration order approximates the order in which backward makes gradients.
        params = [p for p in self.module.parameters() if p.requires_grad][::-1]
        by_kind: dict[tuple[torch.dtype, torch.dtype, bool], list[nn.Parameter]] = {}
        for p in params:
            grad_dtype = torch.float32 if self.accumulate_allreduce_grads_in_fp32 else p.dtype
            by_kind.setdefault((p.dtype, grad_dtype, is_expert(p)), []).append(p)
        deferred = {id(p) for p in self._deferred_params()}  # by identity: == is elementwise
        for (_, grad_dtype, expert), group_params in by_kind.items():
            group, size, scale = self._reduction_of(expert)
            buffer = ParamAndGradBuffer(
                group_params, grad_dtype, self.bucket_size, group, size,
                shard_over_dp=self.use_distributed_optimizer,
                isolate=[p for p in group_params if id(p) in deferred], grad_scale=scale,
            )
            self.buffers.append(buffer)
            for bucket in buffer.buckets:
                for p in bucket.params:
                    self._bucket_of[p] = bucket
                    self._buffer_of[p] = buffer

    # Gradient accumulation and synchronization -------------------------------------------------

    def _accumulate_hook(self, param: nn.Parameter) -> None:
        if param.grad is not None and not grad_already_added(param):
            param.main_grad.add_(param.grad)
        param.grad = None
        if not (self.overlap_grad_reduce and self.is_last_microbatch):
            return
        bucket = self._bucket_of[param]
        if bucket.launched:
            raise RuntimeError(
                "a gradient arrived after its bucket was already being reduced over data "
                "parallel (a parameter used by two backward passes in the last micro-batch?)"
            )
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params) and not bucket.deferred:
            self._buffer_of[param].launch(bucket, async_op=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate (micro-batches before the last one)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch, asynchronously, the reduction of every bucket not launched yet.

        Deferred buckets (the shared embedding weight) wait for ``finish_grad_sync``.
        """
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                if not bucket.launched and not bucket.deferred:
                    buffer.launch(bucket, async_op=True)

    def finish_grad_sync(self) -> None:
        """Average all gradients over data parallel (after the last micro-batch's backward).

        Afterwards ``main_grad`` holds the average (with the distributed optimizer: only in
        the shard of the buffer this rank owns).
        """
        for buffer in self.buffers:
            buffer.finish()

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (call before the first micro-batch of a step)."""
        for buffer in self.buffers:
            buffer.zero()
        for param in self._buffer_of:
            param.grad = None

    def broadcast_params(self) -> None:
        """Copy every parameter from data-parallel rank 0 to the other data-parallel ranks."""
        if self.data_parallel_size == 1:
            return
        for param in self.module.parameters():
            group = (parallel_state.get_expert_data_parallel_group() if is_expert(param)
                     else self.data_parallel_group)
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    # Pass-through ------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapper lacks (set_input_tensor, shared_embedding_or_output_weight,
        # ...) come from the wrapped model, so schedules need not unwrap it.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside any stack of wrappers that expose it as ``.module``."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model

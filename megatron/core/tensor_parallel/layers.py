"""Linear and embedding layers split across the tensor-parallel group.

Weights are initialised as one full master weight (fp32, on the CPU, by the caller's
``init_method``) and then split, so the same seed gives the same model at any tensor-parallel
size. ``init_method(tensor)`` fills a full-size tensor in place; pass ``None`` (or
``perform_initialization=False``) to leave the parameters uninitialised, e.g. on the meta
device or before loading a checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.grad_accumulation import (
    accumulate_rows_,
    accumulate_weight_grad,
    main_grad_of,
    mark_layer_weight,
)
from megatron.core.tensor_parallel import mappings
from megatron.core.utils import divide, set_tensor_model_parallel_attributes

InitMethod = Callable[[torch.Tensor], object]


# (world size, rank) that layers built without a group assume; see assume_tensor_parallel_rank.
_ASSUMED_TP: ContextVar[Optional[tuple[int, int]]] = ContextVar("assumed_tp", default=None)


@contextlib.contextmanager
def assume_tensor_parallel_rank(world_size: int, rank: int) -> Iterator[None]:
    """Layers built inside (without an explicit ``tp_group``) take the shapes of
    tensor-parallel rank ``rank`` of ``world_size``, with no process groups.

    For inspecting a layout too large to launch, e.g. one GPT-3 175B stage on the meta
    device. Such layers have the right shard shapes but nothing to communicate over: do not
    run them.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is outside world size {world_size}")
    token = _ASSUMED_TP.set((world_size, rank))
    try:
        yield
    finally:
        _ASSUMED_TP.reset(token)


def _tp_world_and_rank(group) -> tuple[int, int]:
    if group is not None:
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    assumed = _ASSUMED_TP.get()
    if assumed is not None:
        return assumed
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def _init_sharded(param: torch.Tensor, full_shape: tuple[int, ...], dim: int, world: int,
                  rank: int, init_method: Optional[InitMethod], parts: int = 1) -> None:
    """Fill ``param`` with this rank's slice of a full master weight drawn by init_method
    (``parts``: the master is that many parts along ``dim``, a rank holding its slice of
    each, one after another), so every tensor-parallel size starts from the same model."""
    if init_method is None or param.device.type == "meta":
        return
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    shard = torch.cat([part.chunk(world, dim=dim)[rank] for part in master.chunk(parts, dim)],
                      dim=dim)
    with torch.no_grad():
        param.copy_(shard)


def _onednn_linear_op() -> Optional[Callable]:
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear_op()


def matmul_nt(x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias [N])`` -> ``[M, N]``.

    fp32 on CPU goes through oneDNN's matmul (the kernel torch.compile's CPU backend uses),
    which ran 1.2-1.4x faster than the MKL sgemm behind ``torch.mm`` on our AVX-512 AMD CPU,
    with the same fp32 accumulation up to rounding order. ``torch.backends.mkldnn.enabled =
    False`` turns it off.
    """
    if (_ONEDNN_LINEAR is not None and not torch.compiler.is_compiling()
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and torch.backends.mkldnn.enabled):
        if not (weight.is_contiguous() or weight.t().is_contiguous()):
            weight = weight.contiguous()  # a transposed weight is read in place
        return _ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class _Linear(torch.autograd.Function):
    """``F.linear`` with the matmuls of ``matmul_nt``; with ``main_grad`` (the wrapper's
    buffer view, ``megatron/core/grad_accumulation.py``) the weight gradient is added into it
    by the backward and autograd gets an unfilled stand-in, which the wrapper's hook skips.
    Eager and compiled code run the same function (the accumulation is a custom operator)."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        # Not saved for backward: earlier backwards add into it, which is what it is for.
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        y = matmul_nt(x.reshape(-1, x.size(-1)), weight, bias)  # [tokens, out]
        return y.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.size(-1))  # [tokens, out]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_nt(g, weight.t()).view(x.shape)  # [.., in]
        return (grad_x, *_weight_and_bias_grads(ctx, g, x, weight), None)


def _weight_and_bias_grads(ctx, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """The weight and bias gradients of ``y = x W^T + b`` from ``g`` (``[tokens, out]``) and
    the layer's whole input ``x``; the weight's is added into ``ctx.main_grad`` when there is
    one (autograd gets an unfilled stand-in)."""
    grad_weight = grad_bias = None
    if ctx.needs_input_grad[1]:
        x2 = x.reshape(-1, x.size(-1))  # [tokens, in]
        if ctx.main_grad is None:
            grad_weight = g.t().mm(x2)  # [out, in]
        else:
            accumulate_weight_grad(ctx.main_grad, g, x2)
            grad_weight = torch.empty_like(weight)  # the stand-in
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = g.sum(dim=0)
    return grad_weight, grad_bias


class _SequenceParallelLinear(torch.autograd.Function):
    """Sequence parallelism's column-parallel matmul: ``x`` is this rank's ``[s/t, b, in]``
    part of the sequence; the forward all-gathers it and multiplies as ``_Linear`` does. Only
    the part is kept for the backward, which all-gathers it again for the weight gradient and
    reduce-scatters the input gradient (as Megatron-LM does: ``1/t`` of the gathered input's
    memory per layer, for one more all-gather)."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, group):
        ctx.save_for_backward(x, weight)
        ctx.main_grad, ctx.group, ctx.has_bias = main_grad, group, bias is not None
        whole = mappings.gather_sequence(x, group)  # [s, b, in]
        y = matmul_nt(whole.reshape(-1, whole.size(-1)), weight, bias)  # [tokens, out]
        return y.view(*whole.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        whole = mappings.gather_sequence(x, ctx.group)
        g = grad_y.reshape(-1, grad_y.size(-1))  # [tokens, out]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_whole = matmul_nt(g, weight.t()).view(whole.shape)  # partial sums
            grad_x = mappings.reduce_scatter_sequence(grad_whole, ctx.group)
        return (grad_x, *_weight_and_bias_grads(ctx, g, whole, weight), None, None)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., in]`` through ``_Linear``."""
    return _Linear.apply(x, weight, bias, main_grad_of(weight))


_COMPILED_FUSION: dict[str, bool] = {}


def compiled_fusion_works() -> bool:
    """Whether torch.compile'd layers can keep gradient-accumulation fusion on this torch.

    Weights' ``main_grad`` buffers are views of one flat buffer, so they share one version
    counter: torch 2.9's compiled autograd checks the version of the ``main_grad`` that a
    compiled forward captured and fails the backward once another layer has added into the
    buffer (2.13 does not). Tried once per process on two tiny compiled linears (a few
    seconds of compiling, paid only under --compile)."""
    if "works" not in _COMPILED_FUSION:
        _COMPILED_FUSION["works"] = _try_compiled_fusion()
    return _COMPILED_FUSION["works"]


def _try_compiled_fusion() -> bool:
    g = torch.Generator().manual_seed(0)
    weights = [nn.Parameter(torch.randn(4, 4, generator=g)) for _ in range(2)]
    flat = torch.zeros(32)
    for i, w in enumerate(weights):
        w.main_grad = flat[16 * i:16 * (i + 1)].view(4, 4)
        w.fuse_grad_accumulation = True
    step = torch.compile(lambda x, w: linear(x, w).tanh())
    x = torch.randn(3, 4, generator=g)
    try:
        step(step(x, weights[0]), weights[1]).sum().backward()
    except RuntimeError:
        return False
    return bool(flat.abs().sum() > 0)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A split along its output dim: rank i computes ``Y_i = X A_i^T + b_i``.

    Input ``[s, b, in]`` (or ``[s/tp, b, in]`` under sequence parallelism); output
    ``[s, b, out/tp]``, or ``[s, b, out]`` with ``gather_output``.
    """

    def __init__(self, input_size: int, output_size: int, *, init_method: Optional[InitMethod],
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                 tp_group=None, parts: int = 1) -> None:
        """``parts``: the output is that many parts (SwiGLU's gate and up), each split over
        the ranks on its own: a rank's rows are its share of each, one after another."""
        super().__init__()
        self.tp_group = tp_group
        world, rank = _tp_world_and_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, world)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and gather_output:
            raise ValueError("gather_output is incompatible with sequence parallelism")
        kw = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, **kw))
        set_tensor_model_parallel_attributes(self.weight, True, dim=0)
        mark_layer_weight(self.weight)
        _init_sharded(self.weight, (output_size, input_size), 0, world, rank, init_method,
                      parts)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, **kw))
            set_tensor_model_parallel_attributes(self.bias, True, dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``weight`` overrides the layer's own (the tied LM head passes the embedding)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:  # all-gathers x ([s/tp, b, in]) to [s, b, in]
            y = _SequenceParallelLinear.apply(x, weight, self.bias, main_grad_of(weight),
                                              mappings.tensor_parallel_group(self.tp_group))
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x, self.tp_group)
            y = linear(x, weight, self.bias)  # [s, b, out/tp]
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A split along its input dim: ``Y = sum_i X_i A_i^T + b``.

    Input ``[s, b, in/tp]`` (``input_is_parallel``) or ``[s, b, in]``; output ``[s, b, out]``,
    or ``[s/tp, b, out]`` under sequence parallelism (reduce-scatter instead of all-reduce).
    """

    def __init__(self, input_size: int, output_size: int, *, init_method: Optional[InitMethod],
                 bias: bool = True, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                 tp_group=None) -> None:
        super().__init__()
        self.tp_group = tp_group
        world, rank = _tp_world_and_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, world)
        self.input_is_parallel = input_is_parallel
        self.world_size = world
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        kw = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, **kw))
        set_tensor_model_parallel_attributes(self.weight, True, dim=1)
        mark_layer_weight(self.weight)
        _init_sharded(self.weight, (output_size, input_size), 1, world, rank, init_method)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, **kw))
            # Under sequence parallelism each rank adds the bias to its own tokens only, so
            # its gradient is partial and must be summed over the tensor-parallel group.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            # Nothing to reduce: the bias joins the matmul (addmm) instead of another pass.
            return linear(x, self.weight, self.bias)  # [s, b, out]
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = linear(x, self.weight)  # partial sums [s, b, out]
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class _Embedding(torch.autograd.Function):
    """``F.embedding`` whose backward adds the looked-up rows' gradients straight into
    ``weight.main_grad`` when it may, instead of making a dense ``[V, h]`` gradient."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        ids, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.size(-1))  # [tokens, h]
        main_grad = main_grad_of(weight)
        if main_grad is not None:
            accumulate_rows_(main_grad, ids.reshape(-1), grad)
            return None, None
        return None, torch.zeros_like(weight).index_add_(0, ids.reshape(-1), grad)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank i holds rows
    ``[i * V/tp, (i + 1) * V/tp)``; lookups outside a rank's range give zeros there, and the
    all-reduce sums them into the full embedding. Input ``[b, s]`` ids, output ``[b, s, h]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 init_method: Optional[InitMethod], params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, tp_group=None) -> None:
        super().__init__()
        self.tp_group = tp_group
        world, rank = _tp_world_and_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = divide(num_embeddings, world)
        self.vocab_start_index, self.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
        self.world_size = world
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=params_dtype,
                                               device=device))
        set_tensor_model_parallel_attributes(self.weight, True, dim=0)
        mark_layer_weight(self.weight)
        _init_sharded(self.weight, (num_embeddings, embedding_dim), 0, world, rank, init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return _Embedding.apply(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = _Embedding.apply(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.reduce_from_tensor_model_parallel_region(out, self.tp_group)

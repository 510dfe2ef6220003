"""Small helpers shared across core: parameter attributes that describe how a tensor is split.

Conventions (set by the layers, read by optimizers, grad clipping and checkpointing):

- ``param.tensor_model_parallel = True`` with ``param.partition_dim`` and
  ``param.partition_stride``: the parameter is a shard along that dim across the
  tensor-parallel group. Parameters without it are replicated on every tensor-parallel rank.
- ``param.sequence_parallel = True``: a replicated parameter (LayerNorm) whose gradient is
  partial per tensor rank under sequence parallelism and must be all-reduced over that group.
- ``param.shared = True``: a copy of a parameter owned by another pipeline stage (the last
  stage's word embeddings under tied weights); it is kept in sync by the embedding group and
  must not be counted twice by the gradient norm.
"""

from __future__ import annotations

import torch

from megatron.core import parallel_state


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def param_is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True if this rank's copy counts: a shard, or the tensor-rank-0 copy of a replica."""
    return param_is_tensor_parallel(param) or parallel_state.get_tensor_model_parallel_rank() == 0


def param_is_not_shared(param: torch.Tensor) -> bool:
    return not getattr(param, "shared", False)


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; a remainder is a configuration bug, so it raises."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator

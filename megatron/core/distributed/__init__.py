"""Data parallelism: the gradient-buffer wrapper and the end-of-backward gradient reductions."""

from megatron.core.distributed.distributed_data_parallel import (
    DistributedDataParallel,
    default_data_parallel_group,
    unwrap_model,
)
from megatron.core.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    finalize_model_grads,
)
from megatron.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = [
    "Bucket",
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "allreduce_embedding_grads",
    "allreduce_sequence_parallel_grads",
    "default_data_parallel_group",
    "finalize_model_grads",
    "unwrap_model",
]

"""One forward pass of a generation step across the pipeline stages, and the hand-out of
the chosen tokens from the last stage to every stage.

Each rank holds one stage of the model (``GPTModel`` built for its pipeline rank, its tensor
shard of each layer). Stage i receives the hidden state ``[s, b, h]`` from stage i-1, runs its
layers and sends the result on; the last stage's logits, gathered over the tensor-parallel
group, are the same on each of its tensor ranks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.model.gpt_model import GPTModel
from megatron.model.kv_cache import KVCache


def pipeline_size() -> int:
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    return pipeline_size() == 1 or parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def forward_logits(model: GPTModel, input_ids: torch.Tensor, cache: Optional[KVCache],
                   all_positions: bool = False) -> Optional[torch.Tensor]:
    """Logits ``[b, V]`` (full vocabulary, padding included) of the last position of
    ``input_ids`` ``[b, s]`` on the last stage; None on the other stages. With
    ``all_positions`` (no cache), the logits of every position, ``[b, s, V]``.

    With ``cache`` the ids are the positions after those already cached; without, the whole
    sequence so far (every position is recomputed).
    """
    if all_positions and cache is not None:
        raise ValueError("the KV-cached forward gives the last position's logits only")
    if pipeline_size() == 1:
        return _logits(model, input_ids, cache, all_positions)
    b, s = input_ids.shape
    cfg = model.config
    comm = P2PCommunicator((s, b, cfg.hidden_size), cfg.params_dtype, input_ids.device)
    if not comm.is_first_stage:
        hidden, _ = comm.exchange(recv_prev=True)
        model.set_input_tensor(hidden)
    if not comm.is_last_stage:
        comm.exchange(send_next=model(input_ids, inference_cache=cache))
        return None
    return _logits(model, input_ids, cache, all_positions)


def _logits(model: GPTModel, input_ids: torch.Tensor, cache: Optional[KVCache],
            all_positions: bool = False) -> torch.Tensor:
    if cache is not None:
        logits = model(input_ids, inference_cache=cache)  # [b, 1, V/tp]
    else:
        logits = model(input_ids)  # [b, s, V/tp]
    if not all_positions:
        logits = logits[:, -1]  # [b, V/tp]
    if model.parallel_output:  # the last dimension gathered: [b, V] or [b, s, V]
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """The last stage's ``tensor`` on every stage of this pipeline (same shape and dtype
    everywhere; the other stages' values are overwritten)."""
    if pipeline_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return tensor

"""The mixture-of-experts layer under expert parallelism against the same layer holding every
expert, on real gloo groups: each rank routes its own tokens, and the output, the input's and
the router's gradients equal the whole layer's on that rank's tokens, and each local expert's
gradient equals the sum over the expert group of the whole layer's gradients of that expert
(what the expert-data reduction then averages). Both dispatchers, 2 and 4 ranks, with capacity
dropping and padding too."""

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.model import moe
from megatron.model.transformer import ParallelMLP
from tests.dist_utils import run_distributed


def _config(ep: int, **extra) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_experts=4,
                       moe_router_topk=2, hidden_dropout=0.0, attention_dropout=0.0,
                       ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                       expert_model_parallel_size=ep, **extra)


def _layer_step(layer: moe.MoELayer, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out = layer(x)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), x.grad, layer


def _compare(rank, world_size, dispatcher, extra):
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        whole = moe.MoELayer(_config(1, **extra), 1, ParallelMLP).train()
        split = moe.MoELayer(_config(world_size, moe_token_dispatcher_type=dispatcher,
                                     **extra), 1, ParallelMLP).train()
        assert len(split.local_experts) == 4 // world_size
        torch.manual_seed(100 + rank)  # each rank its own tokens
        x = torch.randn(5, 2, 16)
        out_w, grad_w, _ = _layer_step(whole, x)
        out_s, grad_s, _ = _layer_step(split, x)
        assert torch.allclose(out_s, out_w, atol=1e-6), (out_s - out_w).abs().max()
        assert torch.allclose(grad_s, grad_w, atol=1e-6)
        assert torch.allclose(split.router.weight.grad, whole.router.weight.grad, atol=1e-6)
        for param in whole.local_experts.parameters():  # every rank's tokens' share, summed
            dist.all_reduce(param.grad)
        for j, expert in enumerate(split.local_experts):
            same = whole.local_experts[split.first_expert + j]
            assert torch.equal(expert.dense_h_to_4h.weight, same.dense_h_to_4h.weight)
            for mine, total in zip(expert.parameters(), same.parameters()):
                assert mine.allreduce is False
                assert torch.allclose(mine.grad, total.grad, atol=1e-5)
        return float(out_s.sum())
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("extra", [{}, {"moe_expert_capacity_factor": 1.0},
                                   {"moe_expert_capacity_factor": 1.0,
                                    "moe_pad_expert_input_to_capacity": True}],
                         ids=["dropless", "capacity", "padded"])
def test_expert_parallel_layer_equals_the_whole_layer(world, dispatcher, extra):
    run_distributed(_compare, world, dispatcher, extra)

"""Helpers for comparing a tensor-parallel model with its single-process twin."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.model.gpt_model import GPTModel


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=500, hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    fields.update(overrides)
    return ModelConfig(**fields)


def batch(config: ModelConfig, micro_batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (micro_batch, config.seq_length + 1), generator=g)


def loss_and_grads(config: ModelConfig, tokens: torch.Tensor, seed: int = 1,
                   **model_kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    """Build the model, run one forward/backward of the mean loss, return the loss and every
    parameter's gradient gathered to full size (tensor-parallel shards concatenated)."""
    model_parallel_seed(seed)
    model = GPTModel(config, **model_kwargs)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if getattr(p, "sequence_parallel", False) and parallel_state.model_parallel_is_initialized():
            grad = grad.clone()
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = gather_tensor_parallel(p, grad)
    return loss.item(), grads


def gather_tensor_parallel(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or \
            parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def assert_grads_close(got: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")

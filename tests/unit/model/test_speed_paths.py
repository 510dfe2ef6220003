"""The fast paths of the model give the numbers of the plain PyTorch reference paths."""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import linear_vocab_parallel_cross_entropy
from tests.dist_utils import run_distributed

S, B, H, V = 7, 3, 16, 50


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    target = torch.randint(0, V, (S, B), generator=g)
    # Uneven per-token loss weights: a uniform gradient could hide a wrong row scaling.
    grad_loss = torch.rand(S, B, generator=g)
    return hidden, weight, target, grad_loss


def _loss_and_grads(fn, hidden, weight, target, grad_loss):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = fn(hidden, weight, target)
    loss.backward(grad_loss)
    return loss.detach(), hidden.grad, weight.grad


def _unfused(hidden, weight, target):
    return vocab_parallel_cross_entropy(F.linear(hidden, weight), target)


def _torch_reference(hidden, weight, target):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none").view(S, B)


def test_linear_cross_entropy_matches_unfused_and_torch():
    inputs = _inputs()
    got = _loss_and_grads(linear_vocab_parallel_cross_entropy, *inputs)
    for reference in (_unfused, _torch_reference):
        expected = _loss_and_grads(reference, *inputs)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_bf16_matches_unfused():
    inputs = _inputs(torch.bfloat16)
    got = _loss_and_grads(linear_vocab_parallel_cross_entropy, *inputs)
    expected = _loss_and_grads(_unfused, *inputs)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_linear_cross_entropy_leaves_frozen_weight_without_grad():
    hidden, weight, target, grad_loss = _inputs()
    weight = weight.detach()
    linear_vocab_parallel_cross_entropy(hidden, weight, target).backward(grad_loss)
    assert hidden.grad is not None and weight.grad is None


def _split_vocab(rank, world_size):
    """Each rank holds V/2 rows of the output weight; loss and gradients match one process."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        hidden, weight, target, grad_loss = _inputs()
        ref = _loss_and_grads(_torch_reference, hidden, weight, target, grad_loss)
        part = weight.detach().chunk(world_size)[rank].clone()
        loss, grad_hidden, grad_part = _loss_and_grads(linear_vocab_parallel_cross_entropy,
                                                       hidden, part, target, grad_loss)
        torch.distributed.all_reduce(grad_hidden)  # each rank's share of d loss / d hidden
        torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_hidden, ref[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_part, ref[2].chunk(world_size)[rank], rtol=1e-5,
                                   atol=1e-6)
        return True
    finally:
        parallel_state.destroy_model_parallel()


def test_linear_cross_entropy_split_over_two_ranks():
    assert all(run_distributed(_split_vocab, 2))

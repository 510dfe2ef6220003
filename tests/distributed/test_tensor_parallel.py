"""Tensor-parallel GPT equals the single-process GPT: loss and every gathered gradient."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    vocab_parallel_cross_entropy,
)
from tests.dist_utils import run_distributed
from tests.distributed.tp_utils import assert_grads_close, batch, loss_and_grads, tiny_config

VARIANTS = {
    "learned_tied": {},
    "rope_untied": dict(position_embedding_type="rope", untie_embeddings_and_output_weights=True),
    "sequence_parallel": dict(sequence_parallel=True),
}


def _tp_matches_single_process(rank, world_size, variants):
    results = {}
    references = {}
    for name in variants:
        config = tiny_config(**VARIANTS[name])
        references[name] = loss_and_grads(config.replace(sequence_parallel=False), batch(config))
    parallel_state.initialize_model_parallel(world_size)
    for name in variants:
        config = tiny_config(**VARIANTS[name], tensor_model_parallel_size=world_size)
        # Our collectives use the names this torch prefers: none of its deprecation warnings
        # (sequence parallelism all-gathers and reduce-scatters).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = loss_and_grads(config, batch(config))
        deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message)]
        assert not deprecated, deprecated
        ref_loss, ref_grads = references[name]
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), (name, loss, ref_loss)
        assert_grads_close(grads, ref_grads)
        results[name] = loss
    return results


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_process(tp):
    variants = list(VARIANTS) if tp == 2 else ["learned_tied"]
    losses = run_distributed(_tp_matches_single_process, tp, variants)
    assert all(r == losses[0] for r in losses)


def _dropout_repeatable(rank, world_size):
    parallel_state.initialize_model_parallel(world_size)
    config = tiny_config(tensor_model_parallel_size=world_size, hidden_dropout=0.2,
                         attention_dropout=0.2)
    first = loss_and_grads(config, batch(config))
    second = loss_and_grads(config, batch(config))
    no_dropout = loss_and_grads(config.replace(hidden_dropout=0.0, attention_dropout=0.0),
                                batch(config))
    assert first[0] == second[0]
    assert_grads_close(first[1], second[1], rtol=0, atol=0)
    assert abs(first[0] - no_dropout[0]) > 1e-4, "dropout had no effect"
    return first[0]


def test_dropout_under_rng_tracker_is_repeatable():
    losses = run_distributed(_dropout_repeatable, 2)
    assert losses[0] == losses[1]  # the loss is reduced over the tensor group: same everywhere


def _recompute_matches(rank, world_size):
    parallel_state.initialize_model_parallel(world_size)
    config = tiny_config(tensor_model_parallel_size=world_size, num_layers=3,
                         hidden_dropout=0.2, attention_dropout=0.2)
    ref = loss_and_grads(config, batch(config))
    variants = [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective"),
    ]
    for v in variants:
        loss, grads = loss_and_grads(config.replace(**v), batch(config))
        assert loss == ref[0], v
        assert_grads_close(grads, ref[1], rtol=1e-6, atol=1e-8)
    return True


def test_activation_recompute_matches_with_dropout():
    assert all(run_distributed(_recompute_matches, 2))


def _cross_entropy(rank, world_size, label_smoothing):
    parallel_state.initialize_model_parallel(world_size)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 3, 64, generator=g, dtype=torch.float64)
    target = torch.randint(0, 64, (5, 3), generator=g)
    weight = torch.randn(5, 3, generator=g, dtype=torch.float64)
    part = full.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(part, target, label_smoothing=label_smoothing)
    (loss * weight).sum().backward()

    ref_logits = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, 64), target.reshape(-1), reduction="none",
                          label_smoothing=label_smoothing).reshape(5, 3)
    (ref * weight).sum().backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(part.grad, ref_logits.grad.chunk(world_size, dim=-1)[rank],
                               rtol=1e-10, atol=1e-10)
    return True


@pytest.mark.parametrize("tp,smoothing", [(2, 0.0), (4, 0.0), (2, 0.1)])
def test_vocab_parallel_cross_entropy(tp, smoothing):
    assert all(run_distributed(_cross_entropy, tp, smoothing))


def _linear_layers(rank, world_size):
    """Column -> Row parallel equals two plain linears built from the same master weights."""
    parallel_state.initialize_model_parallel(world_size)
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)
    x = torch.randn(4, 3, 8, generator=g)
    col = ColumnParallelLinear(8, 16, init_method=lambda t: t.copy_(w1), bias=False)
    row = RowParallelLinear(16, 8, init_method=lambda t: t.copy_(w2), bias=True)
    y = row(torch.relu(col(x)))
    expected = F.linear(torch.relu(F.linear(x, w1)), w2)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    gathered = ColumnParallelLinear(8, 16, init_method=lambda t: t.copy_(w1), gather_output=True)
    torch.testing.assert_close(gathered(x), F.linear(x, w1), rtol=1e-5, atol=1e-5)
    return True


def test_column_row_parallel_linear():
    assert all(run_distributed(_linear_layers, 2))


def _sequence_parallel_column_layer(rank, world_size):
    parallel_state.initialize_model_parallel(world_size)
    s, b, h, out = 8, 2, 16, 12
    torch.manual_seed(0)
    full_x = torch.randn(s, b, h)
    full = torch.nn.Linear(h, out)
    sp = ColumnParallelLinear(h, out, init_method=None, sequence_parallel=True)
    rows = out // world_size
    with torch.no_grad():
        sp.weight.copy_(full.weight[rank * rows:(rank + 1) * rows])
        sp.bias.copy_(full.bias[rank * rows:(rank + 1) * rows])
    part = full_x.chunk(world_size)[rank].clone().requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = sp(part)  # [s, b, out/t]
    y.square().sum().backward()
    # Only this rank's part of the input is kept for the backward, besides the weight.
    assert sorted(saved) == sorted([part.numel(), sp.weight.numel()]), saved
    x = full_x.clone().requires_grad_()
    # The reference: the same rows of the whole layer, every rank's rows summed into x.grad.
    full(x)[..., rank * rows:(rank + 1) * rows].square().sum().backward()
    grads = [torch.zeros_like(x.grad) for _ in range(world_size)]
    torch.distributed.all_gather(grads, x.grad)
    torch.testing.assert_close(part.grad, sum(grads).chunk(world_size)[rank])
    torch.testing.assert_close(sp.weight.grad, full.weight.grad[rank * rows:(rank + 1) * rows])
    torch.testing.assert_close(sp.bias.grad, full.bias.grad[rank * rows:(rank + 1) * rows])


def test_a_sequence_parallel_column_layer_keeps_only_its_part_of_the_input():
    run_distributed(_sequence_parallel_column_layer, 2)

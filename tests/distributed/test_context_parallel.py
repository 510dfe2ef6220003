"""Context-parallel attention (megatron/core/context_parallel.py) on real gloo groups: each
kind's output and gradients equal plain causal attention over the whole sequence, for
multi-head, grouped-query and too-few-key/value-head attention, at 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import context_parallel as cp
from megatron.core import parallel_state
from tests.dist_utils import run_distributed

B, HEADS, S, D = 2, 4, 16, 8


def _inputs(groups: int):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, HEADS, S, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, groups, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, groups, S, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, HEADS, S, D, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _reference(groups: int):
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(groups)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != HEADS)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


KINDS = ("p2p", "a2a", "allgather", "ulysses")
GROUPS = {2: (4, 2), 4: (2, 1)}  # cp2: multi-head, grouped; cp4: grouped, multi-query


def _split_attention(rank, world_size):
    """Every kind and head grouping in one launch (spawning ranks costs seconds)."""
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    results = {}
    for kind in KINDS:
        for groups in GROUPS[world_size]:
            q, k, v, dout = (cp.shard(t, 2, kind) for t in _inputs(groups))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            out = cp.attention(q, k, v, kind)
            out.backward(dout)
            results[kind, groups] = out.detach(), q.grad, k.grad, v.grad
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_attention_equals_whole_sequence_attention(world_size):
    per_rank = run_distributed(_split_attention, world_size)
    for groups in GROUPS[world_size]:
        expected = _reference(groups)
        for kind in KINDS:
            for rank, got in enumerate(per_rank):
                positions = cp.local_positions(S, world_size, rank, kind)
                for name, mine, whole in zip(("out", "dq", "dk", "dv"), got[kind, groups],
                                             expected):
                    torch.testing.assert_close(mine, whole.index_select(2, positions),
                                               rtol=1e-10, atol=1e-10,
                                               msg=f"{kind} groups {groups} rank {rank} {name}")


def test_load_balanced_chunks_pair_first_and_last():
    assert cp.local_positions(16, 2, 0, "p2p").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp.local_positions(16, 2, 1, "p2p").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp.local_positions(16, 2, 1, "ulysses").tolist() == list(range(8, 16))
    every = torch.cat([cp.local_positions(24, 3, r, "a2a") for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def _masked_loss(rank, world_size):
    from megatron.model.gpt_batch import masked_mean_loss

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    losses = torch.arange(1.0, 17.0).reshape(2, 8).requires_grad_()
    mask = torch.ones(2, 8)
    mask[:, :2] = 0.0  # every token of rank 0's first chunk (of four) masked ...
    mask[:, 6:] = 0.0  # ... and of its second: rank 0 holds no token that counts
    mine, my_mask = (cp.shard(t, 1, "p2p") for t in (losses, mask))
    loss = masked_mean_loss(mine, my_mask)
    loss.backward()
    return loss.detach(), losses.grad


def test_a_rank_whose_tokens_are_all_masked_adds_zero_not_nan():
    """The loss each rank reports is the context group's size times its share, so their
    mean is the whole sequence's masked mean; a rank with no unmasked token gives 0."""
    per_rank = run_distributed(_masked_loss, 2)
    (loss0, grad0), (loss1, grad1) = per_rank
    whole = torch.arange(1.0, 17.0).reshape(2, 8)[:, 2:6].mean()
    assert loss0.item() == 0.0 and torch.isfinite(grad0).all() and not grad0.any()
    torch.testing.assert_close((loss0 + loss1) / 2, whole)
    # d(2 x rank 1's share)/d(each of its 8 counted tokens) = 2/8.
    torch.testing.assert_close(grad1, torch.where(torch.arange(8) % 8 >= 2, 0.25, 0.0)
                               * (torch.arange(8) < 6).float().expand(2, 8))


def test_the_memory_benchmark_runs_and_halves_activations_at_cp2(capsys):
    from tests.distributed.training_utils import load_benchmark

    bench = load_benchmark("context_parallel_memory")
    bench.main(["--seq", "512", "--cp", "2", "--kinds", "p2p"])
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("cp 2 p2p"))
    ratio = float(row.split()[4])
    assert 0.45 < ratio < 0.6, row  # half the tokens, plus what every rank keeps whole

"""The parts of --dp-overlap (issue 15) on 2 gloo ranks, without the training loop.

- ``ParameterGossip.start_average`` averages the values the tensors had when it started, even
  when they change before ``wait()``; tensors of two dtypes each get their own mean;
- ``DecentralizedOptimizer(overlap=True)``: one SGD step is ``mean(x) - lr * g_own``;
  ``cancel_exchange()`` keeps ``x`` and the round; misuse is refused; a step skipped for a
  NaN gradient on one replica is skipped on both, which still take the average;
- through pretrain(): an iteration with a NaN loss (every rank skips it) drops its exchange
  and keeps the parameters; one with a NaN gradient on rank 1 skips on both but averages;
- ``--dp-overlap`` without ``--dp-mode decentralized`` is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.config import ConfigError, OptimizerConfig, ParallelConfig
from megatron.core import parallel_state
from megatron.core.distributed.gossip import ParameterGossip
from megatron.core.optimizer.decentralized import DecentralizedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer
from tests.dist_utils import run_distributed
from tests.distributed.test_nonfinite_guard import Injector, _pretrain
from tests.distributed.training_utils import base_argv, build_small_corpus

LR = 0.1


def _gossip() -> ParameterGossip:
    return ParameterGossip("complete", [[0, 1]],
                           full_group=parallel_state.get_data_parallel_group())


def _optimizer(rank: int) -> tuple[nn.Module, DecentralizedOptimizer]:
    torch.manual_seed(rank)  # the replicas differ
    model = nn.Linear(3, 2)
    groups = [{"params": list(model.parameters())}]
    config = OptimizerConfig(lr=LR, clip_grad=0.0, check_for_nan_in_loss_and_grad=True)
    inner = FP32Optimizer(config, groups,
                          lambda g: torch.optim.SGD(g, lr=LR))
    return model, DecentralizedOptimizer(inner, _gossip(), overlap=True)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _parts(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(1, 1)
    try:
        out = {}
        a = torch.full((3,), float(rank + 1))
        b = torch.full((2,), float(10 * (rank + 1)), dtype=torch.float64)
        pending = _gossip().start_average([a, b], round_index=0)
        a.fill_(100.0)  # changed while the exchange runs: the start's values are averaged
        pending.wait()
        out["a"], out["b"] = a, b

        model, optimizer = _optimizer(rank)
        out["x0"] = _flat(model)
        optimizer.start_exchange()
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        out["grad"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        optimizer.step()
        out["x1"], out["rounds"] = _flat(model), optimizer.rounds_done

        optimizer.start_exchange()
        optimizer.cancel_exchange()
        out["x1_kept"], out["rounds_kept"] = _flat(model), optimizer.rounds_done
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="without start_exchange"):
            optimizer.step()
        optimizer.start_exchange()
        with pytest.raises(RuntimeError, match="twice"):
            optimizer.start_exchange()
        optimizer.cancel_exchange()

        optimizer.start_exchange()  # a NaN gradient on rank 1 only: both skip, both average
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        if rank == 1:
            model.weight.grad[0, 0] = float("nan")
        out["nan_applied"], _, _ = optimizer.step()
        out["x2"], out["rounds_nan"] = _flat(model), optimizer.rounds_done
        return out
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_parts, 2)


def test_start_average_means_the_values_at_the_start(ranks):
    for rank in ranks:
        torch.testing.assert_close(rank["a"], torch.full((3,), 1.5))
        assert rank["b"].dtype == torch.float64
        torch.testing.assert_close(rank["b"], torch.full((2,), 15.0, dtype=torch.float64))


def test_overlapped_step_is_mean_minus_own_update(ranks):
    mean = (ranks[0]["x0"] + ranks[1]["x0"]) / 2
    assert not torch.allclose(ranks[0]["x0"], ranks[1]["x0"])
    for rank in ranks:
        torch.testing.assert_close(rank["x1"], mean - LR * rank["grad"], rtol=0, atol=1e-6)
        assert rank["rounds"] == 1


def test_cancel_keeps_the_parameters_and_the_round(ranks):
    for rank in ranks:
        assert torch.equal(rank["x1_kept"], rank["x1"])
        assert rank["rounds_kept"] == 1


def test_a_step_skipped_on_one_replica_is_skipped_on_all_and_still_averages(ranks):
    mean = (ranks[0]["x1"] + ranks[1]["x1"]) / 2
    for rank in ranks:
        assert rank["nan_applied"] is False
        torch.testing.assert_close(rank["x2"], mean, rtol=0, atol=1e-6)
        assert rank["rounds_nan"] == 2


def test_overlap_needs_decentralized_mode():
    with pytest.raises(ConfigError, match="--dp-overlap needs --dp-mode decentralized"):
        ParallelConfig(world_size=2, dp_overlap=True)
    ParallelConfig(world_size=2, dp_mode="decentralized", dp_overlap=True)


def _train_with_nans(rank: int, world_size: int, corpus: str, folder: str) -> dict:
    # iteration 2: a NaN loss on rank 1; iteration 4: a NaN gradient on rank 1
    injector = Injector(rank, nan_loss=[(2, 1, 0)], nan_grad=[(4, 1, 0)])
    argv = base_argv(corpus, f"{folder}/cache", **{
        "--global-batch-size": 8, "--train-iters": 6, "--lr-warmup-iters": 0,
        "--dp-mode": "decentralized", "--dp-overlap": True})
    code, state, out, err = _pretrain(argv, injector)
    return dict(code=code, err=err, history=state and state.history,
                unchanged=injector.unchanged)


def test_pretrain_with_overlap_skips_nan_iterations_on_both_replicas(tmp_path):
    corpus = build_small_corpus(str(tmp_path / "corpus"))
    results = run_distributed(_train_with_nans, 2, corpus, str(tmp_path), timeout=120)
    for run in results:
        assert run["code"] == 0, run["err"]
        assert [h["iteration"] for h in run["history"] if h["skipped"]] == [2, 4]
        # 2: no step and no average; 4: no local step, but the replicas (apart since the
        # overlapped step 3) are averaged
        assert run["unchanged"] == {1: False, 2: True, 3: False, 4: False, 5: False}

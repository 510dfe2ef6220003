"""--dp-mode decentralized: a step skipped as non-finite on one replica is skipped on all.

Two gloo ranks, one replica each; rank 1's gradient holds a NaN (fp32 with
--check-for-nan-in-loss-and-grad) or an Inf (fp16 overflow), rank 0's is finite. The
replicas do not share gradients, so each one's norm is its own: without the agreement over the
data-parallel group rank 0 would step (and its LR schedule and loss scale move on) while rank 1
skips. Both must skip, keep their parameters, and (fp16) back the loss scale off alike.
(--dp-mode decentralized refuses --fp16 today; the optimizer's rule is tested for when it
does not.) Then the same through pretrain(): a NaN gradient injected on rank 1 only (as
test_nonfinite_guard injects) skips that iteration on both ranks, which then train on alike.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import OptimizerConfig
from megatron.core import parallel_state
from megatron.core.distributed.gossip import ParameterGossip
from megatron.core.optimizer.decentralized import DecentralizedOptimizer
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer
from tests.dist_utils import run_distributed
from tests.distributed.test_nonfinite_guard import Injector, _pretrain
from tests.distributed.training_utils import base_argv, build_small_corpus


def _sgd(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.1)


def _optimizer(fp16: bool) -> tuple[nn.Module, DecentralizedOptimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    groups = [{"params": list(model.parameters())}]
    if fp16:
        model.half()
        config = OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=2.0**8)
        inner = MixedPrecisionOptimizer(config, groups, _sgd,
                                        DynamicGradScaler(initial_scale=2.0**8, min_scale=1.0,
                                                          hysteresis=1))
    else:
        config = OptimizerConfig(lr=0.1, check_for_nan_in_loss_and_grad=True)
        inner = FP32Optimizer(config, groups, _sgd)
    gossip = ParameterGossip("complete", [[0, 1]],
                             full_group=parallel_state.get_data_parallel_group())
    return model, DecentralizedOptimizer(inner, gossip)


def _one_step(rank: int, world_size: int, fp16: bool) -> dict:
    parallel_state.initialize_model_parallel(1, 1)
    try:
        model, optimizer = _optimizer(fp16)
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        if rank == 1:  # this replica only
            model.weight.grad[0, 0] = float("inf") if fp16 else float("nan")
        applied, _, _ = optimizer.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return dict(applied=applied, unchanged=unchanged,
                    scale=float(optimizer.get_loss_scale()))
    finally:
        parallel_state.destroy_model_parallel()


def test_nan_gradient_on_one_replica_skips_the_step_on_every_replica():
    results = run_distributed(_one_step, 2, False)
    assert [r["applied"] for r in results] == [False, False]
    assert all(r["unchanged"] for r in results)


def test_fp16_overflow_on_one_replica_backs_off_every_replica():
    results = run_distributed(_one_step, 2, True)
    assert [r["applied"] for r in results] == [False, False]
    assert all(r["unchanged"] for r in results)
    assert [r["scale"] for r in results] == [2.0**7, 2.0**7]  # hysteresis 1: halved at once


def _train_with_nan_on_rank_1(rank: int, world_size: int, corpus: str, folder: str) -> dict:
    injector = Injector(rank, nan_grad=[(3, 1, 0)])  # iteration 3, rank 1, micro-batch 0
    argv = base_argv(corpus, f"{folder}/cache", **{
        "--global-batch-size": 8, "--train-iters": 5, "--lr-warmup-iters": 0,
        "--dp-mode": "decentralized"})
    code, state, out, _ = _pretrain(argv, injector)
    return dict(code=code, history=state.history, unchanged=injector.unchanged, log=out)


def test_pretrain_skips_a_nan_gradient_of_one_replica_on_both(tmp_path):
    corpus = build_small_corpus(str(tmp_path / "corpus"))
    # Without the agreement the ranks call different collectives and hang: fail in 2 minutes.
    results = run_distributed(_train_with_nan_on_rank_1, 2, corpus, str(tmp_path), timeout=120)
    for run in results:
        assert run["code"] == 0
        assert [h["iteration"] for h in run["history"] if h["skipped"]] == [3]
        assert run["unchanged"] == {1: False, 2: False, 3: True, 4: False}
    # The same step count, so the same learning rates and reduced losses on both replicas.
    assert repr([(h["iteration"], h["skipped"], h["losses"]) for h in results[0]["history"]]) \
        == repr([(h["iteration"], h["skipped"], h["losses"]) for h in results[1]["history"]])
    assert "non-finite gradients on ranks 1" in results[0]["log"]

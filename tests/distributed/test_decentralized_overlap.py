"""--dp-overlap (issue 15, item 2): the neighbour exchange overlapped with forward/backward.

Four real gloo ranks through pretrain(), one replica each:

- complete topology, plain SGD: every step is ``x_{t+1,i} = mean_j x_{t,j} - lr * g_i(x_{t,i})``
  (within 1e-5), checked from the parameters and gradients recorded on every rank at every
  step; the parameters do not move between the exchange's start and the step (the gradient is
  taken at the replica's own x_t), and the replicas differ (it is not all-reduce);
- ring: the replicas stay within the bound derived below;
- a run saved and resumed (ring, AccumAdamW) continues exactly as one that was not stopped.

The bound. With ``--sgd-momentum 0 --weight-decay 0 --clip-grad c`` and a constant ``lr`` the
local update ``d`` of a replica has norm at most ``lr * c``. The overlapped step is
``x_{t+1} = W_t x_t - d_t``; with 4 ranks the two rounds of ring multiply to the exact average
``J`` and ``(I - J) J = 0``, so ``(I - J) x_T = -(I - J) (W_{T-1} d_{T-2} + d_{T-1})``: two
replicas differ by at most the largest difference of two pair-averages of updates plus that of
two updates, ``||x_i - x_j|| <= 4 * lr * c`` (twice the synchronous bound: the last update is
not averaged at all).
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer.decentralized import DecentralizedOptimizer
from megatron.core.optimizer.optimizer import model_grad
from tests.dist_utils import run_distributed
from tests.distributed.test_decentralized import LR, STEPS, WORLD, _train
from tests.distributed.training_utils import build_small_corpus

OVL = {"--dp-mode": "decentralized", "--dp-overlap": True}
PLAIN_SGD = {**OVL, "--optimizer": "sgd", "--sgd-momentum": 0.0, "--weight-decay": 0.0}
RING_STEPS, RING_CLIP = 20, 0.1
RESUME = {**OVL, "--dp-topology": "ring", "--optimizer": "accumadamw", "--accum-steps": 2,
          "--lr": 3e-3, "--train-iters": 2 * STEPS, "--save-interval": STEPS}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _recording(trace: list):
    """Patches DecentralizedOptimizer to record, per iteration, the parameters when the
    exchange starts, the parameters and gradients just before the step, and after it."""
    start, step = DecentralizedOptimizer.start_exchange, DecentralizedOptimizer.step

    def recorded_start(self):
        trace.append({"start": _flat(self.inner.get_main_params())})
        start(self)

    def recorded_step(self):
        params = self.inner.get_main_params()
        trace[-1].update(before=_flat(params), grad=_flat(model_grad(p) for p in params))
        result = step(self)
        trace[-1]["after"] = _flat(self.inner.get_main_params())
        return result

    return recorded_start, recorded_step


def _all_runs(rank, world_size, corpus, folder):
    cache = f"{folder}/cache"
    trace: list = []
    original = DecentralizedOptimizer.start_exchange, DecentralizedOptimizer.step
    DecentralizedOptimizer.start_exchange, DecentralizedOptimizer.step = _recording(trace)
    try:
        complete = _train(corpus, cache, **PLAIN_SGD, **{"--dp-topology": "complete"})
    finally:
        DecentralizedOptimizer.start_exchange, DecentralizedOptimizer.step = original
    runs = {
        "complete": {**complete, "trace": trace},
        "ring": _train(corpus, cache, **PLAIN_SGD, **{"--dp-topology": "ring",
                                                       "--train-iters": RING_STEPS,
                                                       "--clip-grad": RING_CLIP}),
        "straight": _train(corpus, cache, **RESUME, **{"--save": f"{folder}/straight"}),
        "first": _train(corpus, cache, **RESUME, **{"--save": f"{folder}/resumed",
                                                     "--exit-interval": STEPS}),
        "second": _train(corpus, cache, **RESUME, **{"--save": f"{folder}/resumed",
                                                      "--load": f"{folder}/resumed"}),
    }
    said = "while it computes its gradient (--dp-overlap)" in runs["ring"]["log"]
    assert said or rank != 0
    for run in runs.values():
        del run["log"]
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    corpus = build_small_corpus(str(tmp_path_factory.mktemp("corpus")))
    folder = str(tmp_path_factory.mktemp("overlap"))
    return run_distributed(_all_runs, WORLD, corpus, folder)


def test_complete_topology_follows_the_overlapped_formula(ranks):
    traces = [rank["complete"]["trace"] for rank in ranks]
    assert all(len(trace) == STEPS for trace in traces)
    for t in range(STEPS):
        steps = [trace[t] for trace in traces]
        mean = torch.stack([s["start"] for s in steps]).mean(dim=0)
        for s in steps:
            # the gradient is taken where the exchange started: the parameters did not move
            assert torch.equal(s["before"], s["start"])
            torch.testing.assert_close(s["after"], mean - LR * s["grad"], rtol=0, atol=1e-5)
        if t > 0:  # the replicas really differ (by their last local step): not all-reduce
            assert not torch.allclose(steps[0]["start"], steps[1]["start"])


def test_ring_replicas_stay_within_the_bound(ranks):
    params = [rank["ring"]["params"] for rank in ranks]
    gaps = [float((a - b).norm()) for i, a in enumerate(params) for b in params[i + 1:]]
    bound = 4 * LR * RING_CLIP  # see the module docstring
    assert max(gaps) <= bound * (1 + 1e-4), (gaps, bound)
    assert max(gaps) > 0
    assert all(r["ring"]["iteration"] == RING_STEPS for r in ranks)


def test_resume_with_overlap_is_exact(ranks):
    for rank in ranks:
        straight, first, second = (rank[k] for k in ("straight", "first", "second"))
        assert first["iteration"] == STEPS and second["iteration"] == 2 * STEPS
        assert first["losses"] + second["losses"] == straight["losses"]
        assert torch.equal(second["params"], straight["params"])

"""DeepSpeed's engine refuses non-finite steps as the built-in engine does (2 gloo ranks).

The same NaN as in test_nonfinite_guard.py (rank 1's second micro-batch loss at iteration 2,
rank 0's gradient at iteration 4) goes through the built-in engine, DeepSpeed's plain engine
at ZeRO stage 0 (whose bare torch optimizer DeepSpeed itself would let apply the NaN) and at
ZeRO-1: the same iterations are skipped and counted, and every loss equals the built-in
engine's. DeepSpeed's pipeline engine (pp 2) skips a NaN it only sees in its own schedule,
and training goes on finite. NaN losses in a row stop a DeepSpeed run after
--max-consecutive-nonfinite-iterations with the built-in engine's message.
"""

from __future__ import annotations

import math
import shutil

import pytest

import pretrain_gpt
from megatron.core import parallel_state
from megatron.integrations import deepspeed as ds_integration
from tests.dist_utils import run_distributed
from tests.distributed.test_deepspeed_engine import argv, zero
from tests.distributed.test_nonfinite_guard import Injector, _pretrain

pytestmark = pytest.mark.skipif(shutil.which("deepspeed") is None,
                                reason="deepspeed is not installed")
ITERS = 6
RUN = {"--train-iters": ITERS, "--lr-decay-iters": ITERS, "--eval-iters": 0}


def _history(state) -> list[tuple]:
    return [(h["iteration"], h["skipped"], h["nonfinite"], h["losses"].get("lm loss"))
            for h in state.history]


def _poison_pipeline_stage0(original, call: int):
    """``original`` setup_engine, with a forward hook on stage 0's module that makes its
    ``call``-th output NaN (the pipeline engine runs its own forward: no forward_step to
    inject into)."""
    calls = [0]

    def hook(module, inputs, output):
        calls[0] += 1
        return output * float("nan") if calls[0] == call else output

    def setup(*args, **kwargs):
        run = original(*args, **kwargs)
        if parallel_state.get_pipeline_model_parallel_rank() == 0:
            run.engine.module.register_forward_hook(hook)
        return run

    return setup


def _runs(rank, world_size):
    out = {}
    for name, flags in (("native", argv(**RUN)), ("zero0", zero(0, **RUN)),
                        ("zero1", zero(1, **RUN))):
        inject = Injector(rank, nan_loss=[(2, 1, 1)], nan_grad=[(4, 0, 0)])
        code, state, _, _ = _pretrain(flags, inject)
        out[name] = dict(code=code, history=_history(state))
    # Pipeline engine, pp 2 (4 micro-batches of 2): the first micro-batch of iteration 2.
    original = ds_integration.setup_engine
    ds_integration.setup_engine = _poison_pipeline_stage0(original, call=5)
    try:
        pipe = argv(**RUN, **{"--deepspeed": True, "--pipeline-model-parallel-size": 2})
        code, state, _, _ = _pretrain(pipe, pretrain_gpt.forward_step)
    finally:
        ds_integration.setup_engine = original
    out["pipe"] = dict(code=code, history=_history(state))
    stop = Injector(rank, nan_loss=[(2, 0, 0), (3, 1, 0)])
    flags = zero(0, **RUN, **{"--max-consecutive-nonfinite-iterations": 2})
    code, _, _, err = _pretrain(flags, stop)
    out["stop"] = dict(code=code, err=err, calls=stop.calls)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_runs, 2, timeout=900)


@pytest.mark.slow
def test_deepspeed_skips_and_counts_nonfinite_steps_as_the_built_in_engine(ranks):
    for result in ranks:
        native = result["native"]["history"]
        assert [h[0] for h in native if h[1]] == [2, 4] == [h[0] for h in native if h[2]]
        for name in ("zero0", "zero1"):
            got = result[name]["history"]
            assert result[name]["code"] == 0
            assert [h[:3] for h in got] == [h[:3] for h in native], name
            for (it, _, _, loss), (_, _, _, ref) in zip(got, native):
                assert (math.isnan(loss) and math.isnan(ref)) or \
                    math.isclose(loss, ref, rel_tol=1e-5), (name, it, loss, ref)


@pytest.mark.slow
def test_deepspeed_pipeline_engine_skips_a_nan_of_its_own_schedule(ranks):
    pipe = ranks[0]["pipe"]["history"]
    assert [h[0] for h in pipe if h[1]] == [2] and [h[0] for h in pipe if h[2]] == [2]
    # Applied, the NaN step would have left NaN weights: every later loss is finite.
    assert math.isnan(pipe[1][3]) and all(math.isfinite(h[3]) for h in pipe[2:])


@pytest.mark.slow
def test_deepspeed_stops_after_too_many_nonfinite_iterations_in_a_row(ranks):
    stop, stop_1 = ranks[0]["stop"], ranks[1]["stop"]
    assert stop["code"] == stop_1["code"] == 1
    assert stop["calls"] == stop_1["calls"] == 3 * 2  # stopped after iteration 3
    assert "error: 2 iterations in a row (2-3) had a NaN/Inf loss or grad norm" in stop["err"]
    assert stop_1["err"] == ""


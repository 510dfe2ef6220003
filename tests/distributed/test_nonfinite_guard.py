"""The non-finite guard on two data-parallel ranks (gloo), with NaN injected where we choose.

Run 1 (distributed optimizer, a checkpoint every iteration): rank 1's second micro-batch
returns a NaN loss at iteration 3, and rank 0's first micro-batch a NaN gradient (finite
loss) at iteration 5. Both steps are skipped on both ranks: the parameters stay exactly as
they were, the learning rate does not advance, no checkpoint is written at them, and the log
names the rank and micro-batch (iteration 3) or the grad norm and the ranks holding NaN
gradients (iteration 5). Training then goes on to the end.

Run 2: --max-consecutive-nonfinite-iterations 2 and NaN losses at iterations 2 and 3 stop
the run on both ranks at iteration 3 (SystemExit(1), a message on stderr).
"""

import contextlib
import io
import re

import pytest
import torch

import pretrain_gpt
from megatron.checkpointing import list_iterations
from megatron.core import parallel_state
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import (
    base_argv,
    build_small_corpus,
    captured_stdout,
    parse_log_lines,
)

NUM_MICRO = 2  # global batch 8 = micro-batch 2 x 2 data-parallel ranks x 2
FLAGS = {"--global-batch-size": 8, "--train-iters": 8, "--lr-warmup-iters": 0}


class Injector:
    """pretrain_gpt's forward_step, with NaN put into chosen (iteration, rank, micro-batch)
    places, and a note per iteration of whether the parameters changed since the last."""

    def __init__(self, rank: int, nan_loss=(), nan_grad=()) -> None:
        self.rank, self.nan_loss, self.nan_grad = rank, set(nan_loss), set(nan_grad)
        self.calls = 0
        self.snapshot = None
        self.unchanged: dict[int, bool] = {}  # iteration -> params equal to the previous one's

    def __call__(self, ctx, data_iterator, model, stage):
        iteration, micro = divmod(self.calls, NUM_MICRO)
        iteration += 1
        self.calls += 1
        if micro == 0:
            params = [p.detach().clone() for p in model.parameters()]
            if self.snapshot is not None:
                self.unchanged[iteration - 1] = all(
                    torch.equal(a, b) for a, b in zip(self.snapshot, params))
            self.snapshot = params
        output, loss_func = pretrain_gpt.forward_step(ctx, data_iterator, model, stage)
        where = (iteration, self.rank, micro)
        if where in self.nan_grad:
            output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        if where in self.nan_loss:
            return output, lambda out: _nan_loss(loss_func(out))
        return output, loss_func


def _nan_loss(result):
    loss, reported = result
    loss = loss * float("nan")
    return loss, {name: loss.detach() for name in reported}


def _pretrain(argv, forward_step):
    parallel_state.destroy_model_parallel()  # each pretrain() makes its own groups
    err = io.StringIO()
    code = 0
    with captured_stdout() as out, contextlib.redirect_stderr(err):
        try:
            state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                             pretrain_gpt.model_provider, forward_step, argv=argv)
        except SystemExit as exit_:
            code, state = exit_.code, None
    return code, state, out.getvalue(), err.getvalue()


def _runs(rank, world_size, corpus, folder):
    cache = f"{folder}/cache"
    skip = Injector(rank, nan_loss=[(3, 1, 1)], nan_grad=[(5, 0, 0)])
    argv = base_argv(corpus, cache, **FLAGS, **{
        "--use-distributed-optimizer": True, "--save": f"{folder}/ckpt", "--save-interval": 1})
    code, state, out, err = _pretrain(argv, skip)
    first = dict(code=code, history=state.history, log=out, unchanged=skip.unchanged)

    stop = Injector(rank, nan_loss=[(2, 0, 0), (3, 1, 0)])
    argv = base_argv(corpus, cache, **FLAGS, **{"--max-consecutive-nonfinite-iterations": 2})
    code, state, out, err = _pretrain(argv, stop)
    second = dict(code=code, log=out, err=err, calls=stop.calls)
    return first, second


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("guard"))
    corpus = build_small_corpus(f"{folder}/corpus")
    return folder, run_distributed(_runs, 2, corpus, folder)


def test_nonfinite_steps_are_skipped_logged_and_never_saved(ranks):
    folder, results = ranks
    (first, _), (first_1, _) = results
    assert first["code"] == 0
    for run in (first, first_1):
        assert [h["iteration"] for h in run["history"]] == list(range(1, 9))
        assert [h["iteration"] for h in run["history"] if h["nonfinite"]] == [3, 5]
        assert [h["iteration"] for h in run["history"] if h["skipped"]] == [3, 5]
        # The skipped steps changed no parameter; every other step changed some.
        assert run["unchanged"] == {1: False, 2: False, 3: True, 4: False, 5: True,
                                    6: False, 7: False}
    # Both ranks saw the same reduced numbers (repr: nan != nan).
    assert repr(first["history"]) == repr(first_1["history"])

    log = first["log"]
    assert ("WARNING: iteration 3: the loss of micro-batch 1 (counted from 0, of 2) on rank 1 "
            "is NaN/Inf; the step was skipped") in log
    assert re.search(r"WARNING: iteration 5: the grad norm \(nan; every micro-batch loss was "
                     r"finite; non-finite gradients on ranks 0-1\) is NaN/Inf", log), log
    assert "not saving a checkpoint at iteration 3" in log
    assert list_iterations(f"{folder}/ckpt") == [1, 2, 4, 6, 7, 8]
    # Megatron's skipped-iteration accounting: the schedule does not step.
    rates = {line["iteration"]: line["learning rate"] for line in parse_log_lines(log)}
    assert rates[3] == rates[2] and rates[5] == rates[4] and rates[4] != rates[3]
    lines = {line["iteration"]: line for line in parse_log_lines(log)}
    assert lines[3]["number of skipped iterations"] == lines[3]["number of nan iterations"] == 1
    assert lines[4]["number of nan iterations"] == 0


def test_too_many_in_a_row_stop_every_rank_with_status_1(ranks):
    _, results = ranks
    (_, second), (_, second_1) = results
    assert second["code"] == second_1["code"] == 1
    assert second["calls"] == second_1["calls"] == 3 * NUM_MICRO  # stopped after iteration 3
    assert "error: 2 iterations in a row (2-3) had a NaN/Inf loss or grad norm" in second["err"]
    assert "--max-consecutive-nonfinite-iterations" in second["err"]
    assert second_1["err"] == ""  # rank 0 speaks for all
    assert "WARNING: iteration 3: the loss of micro-batch 0 (counted from 0, of 2) on rank 1" \
        in second["log"]

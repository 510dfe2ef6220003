"""TrainState.history keeps a bounded window of iterations (megatron/training.py
HISTORY_WINDOW), not one entry per iteration for the whole run: a long run's memory must not
grow with its length. Tests read every iteration of their short runs from it."""

from __future__ import annotations

import contextlib
import io
import re

import pretrain_gpt
from megatron.core import parallel_state
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import flags_to_argv

ITERS = 5


def _argv() -> list[str]:
    return flags_to_argv({
        "--num-layers": 1, "--hidden-size": 16, "--num-attention-heads": 2,
        "--seq-length": 8, "--max-position-embeddings": 8, "--micro-batch-size": 1,
        "--global-batch-size": 1, "--train-iters": ITERS, "--lr": 1e-3,
        "--log-interval": 1, "--eval-iters": 0, "--num-workers": 0, "--mock-data": True,
        "--tokenizer-type": "NullTokenizer", "--vocab-size": 63, "--use-cpu": True})


def _run(rank: int, world_size: int, window: int) -> dict:
    from megatron.training import state as training_state

    training_state.HISTORY_WINDOW = window
    parallel_state.destroy_model_parallel()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = pretrain_gpt.main(_argv())
    return {"history": list(state.history), "maxlen": state.history.maxlen,
            "log": out.getvalue()}


def test_history_keeps_the_last_window_of_iterations():
    [run] = run_distributed(_run, 1, 3, timeout=120)
    assert run["maxlen"] == 3
    assert [h["iteration"] for h in run["history"]] == [3, 4, 5]
    logged = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+)", run["log"])]
    assert len(logged) == ITERS
    for entry, loss in zip(run["history"], logged[-3:]):  # the entries are the newest ones
        assert abs(entry["losses"]["lm loss"] - loss) <= 1e-5 * loss

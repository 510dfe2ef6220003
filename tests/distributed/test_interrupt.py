"""Ctrl-C on two data-parallel ranks (gloo): SIGINT reaches every rank at once, as a
terminal sends it to the whole process group.

- In the middle of writing a checkpoint, without --exit-signal-handler: the save completes
  (the checkpoint loads), then every rank exits with status 130 and rank 0 alone prints one
  line saying which checkpoint is the latest; no traceback anywhere.
- With --exit-signal-handler, during an iteration: as SIGTERM, every rank finishes the
  iteration, saves and returns normally.
- Without it, during an iteration: status 130 on every rank, one line on rank 0, the
  latest checkpoint unchanged, although one rank may then meet its peer gone from a
  collective.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.checkpointing import read_tracker
from megatron.checkpointing.formats.torch import save as checkpoint_save
from megatron.core import parallel_state
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.test_deepspeed_engine import argv

pytestmark = pytest.mark.slow
RUN = {"--train-iters": 6, "--eval-iters": 0, "--save-interval": 2}


def _interrupt_every_rank(pids: list[int]) -> None:
    # This process last: its own handler may interrupt it right after its kill.
    for pid in sorted(pids, key=lambda pid: pid == os.getpid()):
        os.kill(pid, signal.SIGINT)


def _pretrain(flags: list[str], forward_step) -> dict:
    parallel_state.destroy_model_parallel()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                     pretrain_gpt.model_provider, forward_step, argv=flags)
        except SystemExit as exit_:
            code = exit_.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def _at_iteration(pids: list[int], rank: int, iteration: int):
    """pretrain_gpt's forward_step; rank 0 sends the SIGINT in ``iteration``'s first
    micro-batch (2 per iteration)."""
    calls = [0]

    def forward_step(ctx, data_iterator, model, stage):
        calls[0] += 1
        if rank == 0 and calls[0] == 2 * (iteration - 1) + 1:
            _interrupt_every_rank(pids)
        return pretrain_gpt.forward_step(ctx, data_iterator, model, stage)

    return forward_step


def _runs(rank, world_size, folder):
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    results = {}
    # 1. Mid-save: rank 0 (the writer of the only model file) sends it from inside the write.
    write_torch = checkpoint_save.write_torch

    def interrupted_write(*args, **kwargs):
        checkpoint_save.write_torch = write_torch
        _interrupt_every_rank(pids)
        return write_torch(*args, **kwargs)

    checkpoint_save.write_torch = interrupted_write
    try:
        results["save"] = _pretrain(argv(**RUN, **{"--save": f"{folder}/save"}),
                                    pretrain_gpt.forward_step)
    finally:
        checkpoint_save.write_torch = write_torch
    # 2. --exit-signal-handler: handled as SIGTERM.
    results["handler"] = _pretrain(
        argv(**RUN, **{"--save": f"{folder}/handler", "--exit-signal-handler": True}),
        _at_iteration(pids, rank, 3))
    # 3. Mid-step without it (last: the ranks may leave their collectives unevenly).
    results["step"] = _pretrain(argv(**RUN, **{"--save": f"{folder}/step"}),
                                _at_iteration(pids, rank, 3))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("interrupt")
    return folder, run_distributed(_runs, 2, str(folder))


def test_ctrl_c_during_a_save_finishes_it_then_exits_130_with_one_line(ranks):
    folder, (rank0, rank1) = ranks
    assert rank0["save"]["code"] == rank1["save"]["code"] == 130
    save = f"{folder}/save"
    assert rank0["save"]["err"].splitlines() == [
        f"interrupted (SIGINT, Ctrl-C) after iteration 2; the latest checkpoint is iteration 2 "
        f"in --save {save}; resume with --load, or add --exit-signal-handler to save when "
        "interrupted"]
    assert rank1["save"]["err"] == ""
    assert read_tracker(save).iteration == 2
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert "iteration        3/" not in rank0["save"]["out"]


def test_ctrl_c_with_exit_signal_handler_saves_and_exits_like_sigterm(ranks):
    folder, (rank0, rank1) = ranks
    assert rank0["handler"]["code"] == rank1["handler"]["code"] == 0
    assert ("exiting at iteration 3 (SIGINT received with --exit-signal-handler); checkpoint "
            "saved") in rank0["handler"]["out"]
    assert read_tracker(f"{folder}/handler").iteration == 3
    assert rank0["handler"]["err"] == rank1["handler"]["err"] == ""


def test_ctrl_c_during_a_step_exits_130_without_a_traceback(ranks):
    folder, (rank0, rank1) = ranks
    assert rank0["step"]["code"] == rank1["step"]["code"] == 130
    assert rank0["step"]["err"].splitlines() == [
        f"interrupted (SIGINT, Ctrl-C) after iteration 2; the latest checkpoint is iteration 2 "
        f"in --save {folder}/step; resume with --load, or add --exit-signal-handler to save "
        "when interrupted"]
    assert rank1["step"]["err"] == ""
    assert read_tracker(f"{folder}/step").iteration == 2

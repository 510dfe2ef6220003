"""The hang watchdog (stacks once per stall), the timeout flags, and which errors count as a
communication timeout."""

from __future__ import annotations

import threading
import time

import pytest

from megatron.config import ConfigError, parse_args
from megatron.core import timeouts
from megatron.core.watchdog import HangWatchdog, Progress

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--train-iters", "10", "--mock-data"]


def _stalled_in_here(release: threading.Event) -> None:
    release.wait(30)


class _Log:
    """A real file (faulthandler writes to a file descriptor) read back as text."""

    def __init__(self, folder) -> None:
        self.file = open(folder / "stderr.txt", "w+")

    def getvalue(self) -> str:
        self.file.flush()
        self.file.seek(0)
        return self.file.read()


@pytest.mark.slow
def test_a_stall_prints_every_threads_stack_once_then_again_after_progress(tmp_path):
    progress, log = Progress(), _Log(tmp_path)
    out = log.file
    progress.step(12)
    release = threading.Event()
    stuck = threading.Thread(target=_stalled_in_here, args=(release,))
    stuck.start()
    watchdog = HangWatchdog(progress, 0.01, rank=3, stream=out).start()  # 0.6 s
    try:
        time.sleep(2.5)  # several checks: still one dump
        first = log.getvalue()
        assert first.count("no progress") == 1, first
        assert first.startswith("[rank 3] no progress for 1 s (--hang-timeout-minutes) in the "
                                "training step of iteration 12; the Python stack of every "
                                "thread of this rank follows\n"), first
        assert "_stalled_in_here" in first and "test_watchdog.py" in first
        progress.mark("the checkpoint save at iteration 12")
        time.sleep(2.0)
        assert log.getvalue().count("no progress") == 2
        assert "in the checkpoint save at iteration 12;" in log.getvalue()
    finally:
        watchdog.stop()
        release.set()
        stuck.join()
        out.close()


def test_steady_progress_prints_nothing(tmp_path):
    progress, log = Progress(), _Log(tmp_path)
    out = log.file
    watchdog = HangWatchdog(progress, 0.01, rank=0, stream=out).start()
    try:
        for iteration in range(1, 16):
            progress.step(iteration)
            time.sleep(0.1)
    finally:
        watchdog.stop()
    assert log.getvalue() == ""


def test_timeouts_take_fractions_of_a_minute_and_the_hang_timeout_follows():
    t = parse_args([*BASE, "--distributed-timeout-minutes", "0.1"], world_size=1).training
    assert t.distributed_timeout_minutes == 0.1 and t.hang_timeout_minutes == 0.05
    t = parse_args(BASE, world_size=1).training
    assert t.distributed_timeout_minutes == 10 and t.hang_timeout_minutes == 5
    t = parse_args([*BASE, "--hang-timeout-minutes", "0"], world_size=1).training
    assert t.hang_timeout_minutes == 0  # off
    with pytest.raises(ConfigError, match="--hang-timeout-minutes must be non-negative"):
        parse_args([*BASE, "--hang-timeout-minutes", "-1"], world_size=1)
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes must be positive"):
        parse_args([*BASE, "--distributed-timeout-minutes", "0"], world_size=1)


@pytest.mark.parametrize("message,expected", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms "
     "for recv operation to complete", True),
    ("Application timeout caused pair closure", True),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
     "OpType=ALLREDUCE, Timeout(ms)=600000)", True),
    ("Connection closed by peer [127.0.0.1]:14248", False),  # a dead peer: not a timeout
    ("DataLoader worker (pid 12) is killed by signal", False),
])
def test_which_errors_are_communication_timeouts(message, expected):
    assert timeouts.is_timeout(TimeoutError("waited 0:10:00 for rank 0 to start this attempt"))
    assert timeouts.is_timeout(RuntimeError(message)) is expected
    wrapped = ValueError("while saving")
    wrapped.__cause__ = RuntimeError(message)
    assert timeouts.is_timeout(wrapped) is expected


def test_rank_lists_are_short_in_the_one_line_report():
    assert timeouts.format_ranks([3]) == "rank 3"
    assert timeouts.format_ranks([0, 1, 2, 3, 12, 7]) == "ranks 0-3, 7, 12"
    assert timeouts.format_ranks(list(range(0, 1024, 8)), most=4) == \
        "ranks 0, 8, 16, 24, ... (128 ranks)"

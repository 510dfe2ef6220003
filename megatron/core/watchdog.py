"""No silent hangs: what a rank is doing, its stacks when it stalls, one line when a
communication times out.

``Progress`` is where the training loop says what it is doing ("the training step of
iteration 12", "the checkpoint save at iteration 10"). ``HangWatchdog`` watches it from a
thread: after ``--hang-timeout-minutes`` without a new mark it prints the Python stack of every
thread of this rank (``faulthandler``), once per stall. Every rank runs its own, so a stall
prints the stacks of every rank that can still run: the ones waiting in a collective for the
missing rank, and that rank's own if it is stuck in Python rather than stopped.
``exit_on_communication_timeout`` turns a communication that timed out
(``--distributed-timeout-minutes``) into one ``error:`` line per surviving rank and exit
status 1, instead of a traceback (or a wait of torch's default 30 minutes).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Optional

import torch.distributed as dist

from megatron.core import parallel_state, timeouts
from megatron.platform.launch_env import distributed_env

EXIT_STATUS = 1


class Progress:
    """The last thing this rank started, and when (marks come from the training loop)."""

    def __init__(self, phase: str = "start-up") -> None:
        self.phase = phase
        self.since = time.monotonic()
        self.marks = 0
        self._watchdog: Optional[HangWatchdog] = None

    def mark(self, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()
        self.marks += 1

    def step(self, iteration: int) -> None:
        self.mark(f"the training step of iteration {iteration}")

    def watch(self, timeout_minutes: float) -> None:
        """Print this rank's stacks once per stall of ``timeout_minutes`` (0: never), from
        now until ``close``."""
        if timeout_minutes and self._watchdog is None:
            self._watchdog = HangWatchdog(self, timeout_minutes, _rank()).start()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None


class HangWatchdog:
    """A daemon thread that prints this rank's stacks once per stall of ``progress``."""

    def __init__(self, progress: Progress, timeout_minutes: float, rank: int,
                 stream=None) -> None:
        self.progress, self.timeout = progress, timeout_minutes * 60.0
        self.rank, self.stream = rank, stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megatron-hang-watchdog",
                                        daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        reported = None  # the mark whose stall was reported
        while not self._stop.wait(min(self.timeout / 4, 5.0)):
            mark, stalled = self.progress.marks, time.monotonic() - self.progress.since
            if stalled >= self.timeout and reported != mark:
                reported = mark
                self.dump(stalled)

    def dump(self, stalled: float) -> None:
        stream = self.stream or sys.stderr
        stream.write(f"[rank {self.rank}] no progress for {_duration(stalled)} "
                     f"(--hang-timeout-minutes) in {self.progress.phase}; the Python stack "
                     "of every thread of this rank follows\n")
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"


def _rank() -> int:
    """This process's global rank (from its launcher before the process group exists)."""
    return dist.get_rank() if dist.is_initialized() else distributed_env()["rank"]


@contextlib.contextmanager
def exit_on_communication_timeout(progress: Progress) -> Iterator[None]:
    """A communication timeout inside becomes one ``error:`` line on this rank and exit
    status 1. The process leaves with ``os._exit``: tearing down process groups with an
    operation still pending can block, which is what the timeout was there to end."""
    try:
        yield
    except Exception as error:
        if not timeouts.is_timeout(error):
            raise
        grace = timeouts.default_grace(parallel_state.group_timeout())
        line = timeouts.describe_timeout(error, progress.phase, grace, _rank())
        sys.stdout.flush()
        print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)

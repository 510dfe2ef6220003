"""Child processes that die with their parent, and a worker pool that notices a dead worker.

``multiprocessing.Pool`` replaces a worker killed by a signal (the out-of-memory killer sends
SIGKILL) and never completes the task it held, so the parent waited forever. Here each worker
has its own task queue and result pipe, and the parent waits on the result *and* the worker's
exit, so a death stops the run with the worker's pid and signal.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron.data.preprocess.config import WorkerDied
from megatron.data.preprocess.encoding import ChunkEncoder, ChunkResult
from megatron.data.preprocess.reading import Chunk

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: keeps them busy, bounds memory
JOIN_SECONDS = 5.0


def mp_context():
    # fork hands the built tokenizer and splitter to children without pickling or rebuilding.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


# Signals whose parent's handlers a child must not run: it is started with them blocked (a
# stop sent while it is still in Python's own after-fork code would otherwise run the
# parent's handler there and print a traceback) and unblocks them once its own are set.
_CHILD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def start_child(proc: Any) -> None:
    """``proc.start()`` with ``_CHILD_SIGNALS`` held back until ``prepare_child`` in it;
    here they are delivered (if any came meanwhile) as soon as it has started."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_SIGNALS)


def prepare_child(parent_pid: int) -> None:
    """First call in every child (started by ``start_child``): die with the parent, leave
    shutdown to it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the liveness check below still catches a parent gone at start
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the death signal was armed
    # Ctrl-C reaches the whole process group: the parent stops the children and removes the
    # partial files. The parent's SIGTERM handler (inherited by fork) is not for children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_SIGNALS)


def describe_exit(exitcode: Any) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (the out-of-memory killer sends it)" if -exitcode == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {exitcode}"


def receive(conn: Connection, proc: Any, what: str) -> Any:
    """The next message from child ``proc``; raises WorkerDied when it exits without one."""
    wait([conn, proc.sentinel])
    if conn.poll():
        try:
            return conn.recv()
        except (EOFError, OSError):
            pass  # it died while sending: nothing, or half a message, came through
    proc.join(JOIN_SECONDS)
    raise WorkerDied(f"{what} (pid {proc.pid}) died before returning its work: "
                     f"{describe_exit(proc.exitcode)}")


def stop(proc: Any) -> None:
    """Terminate and reap a child; SIGKILL it if SIGTERM does not end it in time."""
    if proc.is_alive():
        proc.terminate()
        proc.join(JOIN_SECONDS)
        if proc.is_alive():
            proc.kill()
    proc.join()


def _worker_main(encoder: ChunkEncoder, tasks: Any, results: Connection, parent: int) -> None:
    prepare_child(parent)
    while True:
        chunk = tasks.get()
        if chunk is None:
            return
        try:
            reply = ("ok", encoder.encode_chunk(chunk))
        except Exception as e:  # the parent re-raises it, as Pool did
            reply = ("error", e)
        results.send(reply)


class WorkerPool:
    """``workers`` processes encoding chunks; results come back in input order."""

    def __init__(self, encoder: ChunkEncoder, workers: int):
        ctx = mp_context()
        self.workers: list[tuple[Any, Any, Connection]] = []
        try:
            for _ in range(workers):
                tasks = ctx.Queue()
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, args=(encoder, tasks, send, os.getpid()),
                                   daemon=True)
                start_child(proc)
                send.close()  # now only the worker holds it: its death gives EOF here
                self.workers.append((proc, tasks, recv))
        except BaseException:
            self.close()
            raise

    def imap(self, chunks: Iterator[Chunk]) -> Iterator[ChunkResult]:
        # Chunk n goes to worker n % workers, so each worker's pipe returns its chunks in order.
        pending: deque = deque()
        for n, chunk in enumerate(chunks):
            worker = n % len(self.workers)
            self.workers[worker][1].put(chunk)
            pending.append(worker)
            if len(pending) > IN_FLIGHT_PER_WORKER * len(self.workers):
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    def _result(self, worker: int) -> ChunkResult:
        proc, _, recv = self.workers[worker]
        status, payload = receive(recv, proc, "tokenizer worker process")
        if status != "ok":
            raise payload
        return payload

    def close(self) -> None:
        for proc, tasks, recv in self.workers:
            stop(proc)
            tasks.cancel_join_thread()  # a dead worker's unread chunks must not block exit
            tasks.close()
            recv.close()
        self.workers = []


def encode_stream(encoder: ChunkEncoder, chunks: Iterator[Chunk],
                  workers: int) -> Iterator[ChunkResult]:
    """Encoded chunks in input order; at most ~2 chunks per worker are in flight."""
    if workers == 1:
        for chunk in chunks:
            yield encoder.encode_chunk(chunk)
        return
    pool = WorkerPool(encoder, workers)
    try:
        yield from pool.imap(chunks)
    finally:
        pool.close()

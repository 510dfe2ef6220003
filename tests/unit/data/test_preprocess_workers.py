"""tools/preprocess_data.py's child processes start with the parent's stop signals held back:
a SIGTERM that reaches a child before it has set its own handlers (the parent stopping its
workers right after starting them, when the input turns out to be bad) ends it quietly
instead of running the parent's handler inside it."""

from __future__ import annotations

import os
import signal
import time

from megatron.data.preprocess.workers import mp_context, prepare_child, start_child


def _parents_handler(signum, frame):
    os.write(2, b"parent's handler ran\n")
    os._exit(7)


def _child(parent: int) -> None:
    time.sleep(0.5)  # the stop arrives here, before the child's own handlers are set
    prepare_child(parent)
    time.sleep(30)


def test_a_stop_before_the_child_is_ready_ends_it_with_sigterm_alone():
    previous = signal.signal(signal.SIGTERM, _parents_handler)
    try:
        proc = mp_context().Process(target=_child, args=(os.getpid(),), daemon=True)
        start_child(proc)
        proc.terminate()
        proc.join(10)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # Without the blocked signals the child would have run _parents_handler (exit code 7).
    assert proc.exitcode == -signal.SIGTERM
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # the parent's mask is back

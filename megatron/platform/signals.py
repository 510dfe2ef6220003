"""SIGTERM and SIGINT (Ctrl-C) during a run: stop cleanly, never half-way through a save.

With ``--exit-signal-handler`` both only mark the run (``received``): the loop agrees across
ranks at the end of the iteration, saves one checkpoint and exits 0, as Megatron does for
SIGTERM; a second signal during that save changes nothing.

Without it SIGTERM keeps its default (the process ends), and SIGINT interrupts as Python's own
handler does (``KeyboardInterrupt``), except while a checkpoint is being written: the save
finishes first and the interrupt comes right after it. While a checkpoint is written in the
background (``--async-save``) both are remembered instead (``while_writing``): the loop stops
at the end of the iteration, finishes that checkpoint, and the run ends as the signal asks
(SIGTERM: status 143; SIGINT: the interrupt below). ``pretrain`` turns the interrupt into
one line on rank 0 and exit status 130 (128 + SIGINT, what a shell reports for Ctrl-C), with
no traceback; an error another rank meets because an interrupted peer left its collective is
part of the same interrupt.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any, Optional

INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT
TERMINATED_EXIT_STATUS = 128 + signal.SIGTERM


class ShutdownSignals:
    """The handlers of one run; ``restore()`` puts the previous ones back."""

    def __init__(self, exit_signal_handler: bool) -> None:
        self.exit_signal_handler = exit_signal_handler
        self.received: Optional[str] = None  # with --exit-signal-handler: "SIGTERM"/"SIGINT"
        self.interrupted = False  # without it: SIGINT arrived
        # Without it: the signal ("SIGTERM"/"SIGINT") that came while a checkpoint was being
        # written in the background.
        self.while_writing: Optional[str] = None
        self._saving = False
        self._writing = False
        self._pending = False
        # The run stops because a rank received an exit signal: this process's own copy of
        # it may still be on its way (SLURM and launchers signal each process separately).
        self.stopping = False
        self._previous: dict[int, Any] = {}
        # Python runs handlers in the main thread only, and only it may install them.
        if threading.current_thread() is not threading.main_thread():
            return
        self._install(signal.SIGINT, self._on_sigint)
        if exit_signal_handler:
            self._install(signal.SIGTERM, self._on_exit_signal)

    def _install(self, signum: int, handler: Any) -> None:
        self._previous[signum] = signal.signal(signum, handler)

    def restore(self) -> None:
        """Put the previous handlers back; after a stop on an exit signal SIGTERM keeps the
        handler that only records it, so that a copy arriving after the checkpoint was saved
        cannot turn the clean exit into a kill (exit status -15)."""
        for signum, handler in self._previous.items():
            if not (self.stopping and signum == signal.SIGTERM):
                signal.signal(signum, handler)
        self._previous.clear()

    def _on_exit_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def _on_signal_while_writing(self, signum: int, frame: Any) -> None:
        if self.while_writing is None:
            self.while_writing = signal.Signals(signum).name

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.exit_signal_handler:
            self._on_exit_signal(signum, frame)
            return
        self.interrupted = True
        if self._writing:
            self._on_signal_while_writing(signum, frame)
            return
        if self._saving:
            self._pending = True  # raised when the save is complete
            return
        raise KeyboardInterrupt

    def was_interrupted(self) -> bool:
        """Whether SIGINT arrived, after letting a pending handler run: an error from a
        collective whose peer was interrupted can reach Python before this process's own
        SIGINT handler has (handlers run between bytecodes, not inside a C++ wait)."""
        try:
            _let_pending_handlers_run()
        except KeyboardInterrupt:
            pass
        return self.interrupted

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint is being written: an interrupt waits until it is complete."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
        if self._pending:
            self._pending = False
            if self._writing:  # the rest of the save goes on in the background
                self.while_writing = self.while_writing or "SIGINT"
                return
            raise KeyboardInterrupt

    def writing_in_background(self, writing: bool) -> None:
        """``--async-save``: a checkpoint is being written in the background (from before its
        writer starts until it is published), or no longer. Meanwhile SIGTERM and SIGINT
        (without --exit-signal-handler) are remembered in ``while_writing``; afterwards
        SIGTERM has its default again."""
        if writing == self._writing:
            return
        self._writing = writing
        if self.exit_signal_handler or threading.current_thread() is not threading.main_thread():
            return
        if writing:
            self._install(signal.SIGTERM, self._on_signal_while_writing)
        elif signal.SIGTERM in self._previous:
            signal.signal(signal.SIGTERM, self._previous.pop(signal.SIGTERM))

    def interrupt(self) -> None:
        """End the run as a Ctrl-C does (every rank, once they agreed that one came)."""
        self.interrupted = True
        raise KeyboardInterrupt


def _let_pending_handlers_run() -> None:
    """Calling a Python function is a point where the interpreter runs pending handlers."""

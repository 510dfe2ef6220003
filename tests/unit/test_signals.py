"""ShutdownSignals: the handlers a run installs, and what restore() leaves behind."""

from __future__ import annotations

import os
import signal

from megatron.platform.signals import ShutdownSignals


def test_restore_puts_the_previous_sigterm_handler_back_after_a_normal_run():
    before = signal.getsignal(signal.SIGTERM)
    signals = ShutdownSignals(exit_signal_handler=True)
    assert signal.getsignal(signal.SIGTERM) is not before
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_after_a_stop_on_an_exit_signal_a_late_sigterm_is_only_recorded():
    before = signal.getsignal(signal.SIGTERM)
    try:
        signals = ShutdownSignals(exit_signal_handler=True)
        signals.stopping = True  # another rank's SIGTERM stopped the run
        signals.restore()
        os.kill(os.getpid(), signal.SIGTERM)  # this process's copy, after the save
        assert signals.received == "SIGTERM"  # the test process is still alive
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, before)

"""Run a command under a wall-clock limit, and leave nothing of it running afterwards.

The command starts in a session (and process group) of its own, so whatever it starts in turn
(spawned ranks, torch.compile's worker pool, a test's subprocesses) goes with it: at the limit
the whole group gets SIGTERM, then SIGKILL after a grace period; after a normal end, any
process of the group still alive (a child left behind) gets SIGKILL, so that nothing holds the
GPU into the next command. Used by ``gpu_check.py`` (each step) and ``train_throughput.py``
(each contender).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import IO, Optional, Union

GRACE_S = 5.0  # between SIGTERM and SIGKILL at the limit


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def run_with_time_limit(command: list[str], limit_s: float, *,
                        stdout: Union[int, IO, None] = None,
                        stderr: Union[int, IO, None] = subprocess.STDOUT,
                        cwd: Optional[str] = None,
                        env: Optional[dict[str, str]] = None) -> Optional[int]:
    """``command``'s exit status, or None where it ran past ``limit_s`` seconds and was
    stopped (its whole process group with it). ``stdout``/``stderr`` as for ``Popen``."""
    proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        return None
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers of a finished command

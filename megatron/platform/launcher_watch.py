"""A torchrun worker ends when its agent is gone.

torchrun's agent starts, watches and restarts its workers, and stops them (SIGTERM, then
SIGKILL 30 s later) when the job ends. An agent killed outright (``kill -9``, the OOM killer)
stops nothing: its workers used to train on to the end as orphans, holding GPUs and writing
checkpoints nobody will restart from. So each worker asks the kernel for SIGTERM when its
parent, the agent, dies (Linux ``prctl(PR_SET_PDEATHSIG)``): the signal the agent itself
would have sent, so what follows is what a stop by torchrun does (the worker ends at once; with
``--exit-signal-handler`` its ranks save one checkpoint and exit). The kernel delivers it even
to a worker stuck in a collective.

Where that cannot be set (another OS), or the agent died before it was, a thread checks the
parent once a second: when the agent is gone it prints one line and sends the same SIGTERM,
then SIGKILL after the agent's own grace of 30 s. With ``--exit-signal-handler`` the worker
lives long enough for that thread to say why it stopped.

Only under torchrun (``TORCHELASTIC_RUN_ID``, which its agent sets for each worker): a run
started from a shell must outlive the shell (``nohup``) as it always has.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Optional

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_SECONDS = 1.0
GRACE_SECONDS = 30.0  # torchrun's own wait between SIGTERM and SIGKILL
_watching: Optional[int] = None  # the agent's pid, once this process watches it


def under_torchrun(env: Mapping[str, str]) -> bool:
    return bool(env.get("TORCHELASTIC_RUN_ID"))


def stop_with_launcher(env: Mapping[str, str] = os.environ) -> Optional[int]:
    """Under torchrun, end this worker when its agent (the parent) is gone; returns the
    agent's pid (None when not under torchrun). Once per process."""
    global _watching
    if _watching is not None or not under_torchrun(env):
        return _watching
    agent = os.getppid()
    _watching = agent
    set_parent_death_signal(signal.SIGTERM)
    # Gone already (this process was handed to init, or the parent changed before the kernel
    # was asked): the kernel will not signal, the thread stops it at once.
    gone = agent == 1 or os.getppid() != agent
    threading.Thread(target=_stop if gone else _watch, args=(env.get("RANK", "?"), agent),
                     name="megatron-launcher-watch", daemon=True).start()
    return agent


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent ends (Linux); False
    where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(rank: str, agent: int) -> None:
    while os.getppid() == agent:
        time.sleep(POLL_SECONDS)
    _stop(rank, agent)


def _stop(rank: str, agent: int) -> None:
    """What the agent would have done: SIGTERM, and SIGKILL if the worker is still here after
    the grace."""
    print(f"error: [rank {rank}] torchrun's agent (pid {agent}) is gone: this worker stops "
          "(SIGTERM, as the agent would send; nothing is left to restart the job)",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)

"""Whether a process is still running, as the fault tests ask after a kill."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper is not). A process that
    ends while its stat file is read is gone too: the read then fails with ESRCH."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"

"""An advisory lock on a ``--save`` folder, so that one run at a time writes checkpoints there.

``SAVE/.megatron-save.lock`` names its holder (host, pid, start time, command) as JSON, and
the holder keeps an ``flock`` on it for as long as it runs; the kernel drops that lock when
the process ends, however it ends. A second run that finds the lock held is refused at
start-up with the holder named; a run that finds the file of a process that is gone (killed,
or on a node that died) takes it over with a warning. A run that ends normally removes the
file. Global rank 0 of a run holds the lock for all its ranks.

On a file system without ``flock`` the file alone decides: a holder on this host is alive
when its pid is; one on another host is taken to be alive (delete the file to go on).

The locks this process holds are kept by path (``_HELD``) so that an earlier run in the same
process that ended by an exception cannot lock out the next one, and are released at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from typing import Optional

from megatron.checkpointing.errors import CheckpointError

logger = logging.getLogger(__name__)

LOCK_FILENAME = ".megatron-save.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD: dict[str, SaveLock] = {}  # this process's locks, by the lock file's real path


@dataclasses.dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    started: str  # ISO 8601, local time with its offset
    command: str = ""

    def describe(self) -> str:
        text = f"host {self.host}, pid {self.pid}, started {self.started}"
        return f"{text}: {self.command}" if self.command else text


def _me() -> LockHolder:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return LockHolder(socket.gethostname(), os.getpid(), started, " ".join(sys.argv)[:300])


def _read_holder(fd: int) -> Optional[LockHolder]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        fields = json.loads(data.decode())
        return LockHolder(str(fields["host"]), int(fields["pid"]), str(fields["started"]),
                          str(fields.get("command", "")))
    except (ValueError, KeyError, TypeError):
        return None  # empty (created, not yet written) or not ours


class SaveLock:
    """The lock of one ``--save`` folder; ``acquire()`` it before writing there."""

    def __init__(self, save_dir: str) -> None:
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_FILENAME)
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[LockHolder]:
        """Take the lock; returns the holder of a stale lock taken over (None if there was
        none). Raises ``CheckpointError`` naming the holder when a live run holds it."""
        os.makedirs(self.save_dir, exist_ok=True)
        earlier = _HELD.get(os.path.realpath(self.path))
        if earlier is not None:  # an earlier run of this process that did not release it
            earlier.release()
        for _ in range(5):  # the holder may remove the file between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                stale = self._lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                self._fd = fd
                _HELD[os.path.realpath(self.path)] = self
                self._write(_me())
                if stale is not None:
                    logger.warning("--save %s: took over the lock of a run that is gone (%s)",
                                   self.save_dir, stale.describe())
                return stale
            os.close(fd)
        raise CheckpointError(f"cannot lock --save {self.save_dir}: {self.path} keeps being "
                              "replaced (another run starting there?)")

    def _lock(self, fd: int) -> Optional[LockHolder]:
        """flock ``fd`` (or judge the holder without flock); returns the previous holder if
        it is gone, raises if it is alive."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(_read_holder(fd)) from None
        except OSError as error:
            if error.errno not in _NO_FLOCK:
                raise
            holder = _read_holder(fd)
            if holder is not None and _may_be_alive(holder):
                raise self._busy(holder) from None
            return holder
        holder = _read_holder(fd)
        return holder if holder is not None and holder.pid != os.getpid() else None

    def _busy(self, holder: Optional[LockHolder]) -> CheckpointError:
        who = holder.describe() if holder is not None else "a process that has not yet " \
            "written its name"
        return CheckpointError(
            f"--save {self.save_dir} is in use by another run ({who}); two runs saving into "
            f"one folder would mix their checkpoints: give this run another --save, or stop "
            f"that run first (if it is gone and its file system has no flock, delete "
            f"{self.path})")

    def _write(self, holder: LockHolder) -> None:
        text = json.dumps(dataclasses.asdict(holder)).encode() + b"\n"
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, text)
        os.fsync(self._fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (a no-op when not held)."""
        if self._fd is None:
            return
        _HELD.pop(os.path.realpath(self.path), None)
        with contextlib.suppress(OSError):
            if _same_file(self._fd, self.path):
                os.remove(self.path)
        os.close(self._fd)  # drops the flock
        self._fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _may_be_alive(holder: LockHolder) -> bool:
    if holder.host != socket.gethostname():
        return True  # cannot tell from here
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return holder.pid != os.getpid()


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock.release()

"""An advisory lock on a ``--save`` folder, so that one run at a time writes checkpoints there.

``SAVE/.megatron-save.lock`` names its holder (host, pid, start time, command) as JSON, and
the holder keeps an ``flock`` on it for as long as it runs; the kernel drops that lock when
the process ends, however it ends. A second run that finds the lock held is refused at
start-up with the holder named; a run that finds the file of a process that is gone (killed,
or on a node that died) takes it over with a warning. A run that ends normally removes the
file. Global rank 0 of a run holds the lock for all its ranks.

On a file system without ``flock`` the file alone decides: a holder on this host is alive
when its pid is; one on another host is taken to be alive (delete the file to go on).

The lock does not outlive its holder. A forked child (a DataLoader worker) would share the
flock through the descriptor it inherits and keep it after the holder died (torchrun's next
attempt then found its own dead rank 0's lock "in use", issue 30); children close that
descriptor as they start (``os.register_at_fork``). And where something else still holds the
flock while the holder the file names is dead on this host (the children of a holder that
predates this), a new run waits ``_ORPHAN_GRACE`` seconds (a run that just took the flock
writes its name well within that) and then takes over by putting a new, locked file in its
place; the replacement is serialized by an flock on the folder, so of two runs taking over at
once one wins and the other finds it alive.

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
import time
from typing import Optional

from megatron.checkpointing.errors import CheckpointError
from megatron.platform.file_modes import write_failure

logger = logging.getLogger(__name__)

LOCK_FILENAME = ".megatron-save.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD: dict[str, SaveLock] = {}  # this process's locks, by the lock file's real path
# Seconds a flock held for a dead holder is watched before it is taken over (see above).
_ORPHAN_GRACE = 2.0
_POLL = 0.1


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
            orphaned = False
            try:
                stale = self._lock(fd)
                if isinstance(stale, _Orphaned):
                    old_fd, fd, stale, orphaned = fd, self._replace(fd), stale.holder, True
                    os.close(old_fd)
                    if fd is None:  # another run replaced it first: look again
                        continue
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                try:
                    _write(fd, _me(), self.path)
                except CheckpointError:
                    os.close(fd)  # the flock goes with it
                    raise
                self._fd = fd
                _HELD[os.path.realpath(self.path)] = self
                if stale is not None:
                    logger.warning("--save %s: took over the lock of a run that is gone (%s)%s",
                                   self.save_dir, stale.describe(),
                                   "; processes it started still held it" if orphaned else "")
                return stale
            os.close(fd)
        raise CheckpointError(f"cannot lock --save {self.save_dir}: {self.path} keeps being "
                              "replaced (another run starting there?)")

    def _lock(self, fd: int) -> Optional[LockHolder | _Orphaned]:
        """flock ``fd`` (or judge the holder without flock); returns the previous holder if
        it is gone (``_Orphaned`` if processes it left still hold the flock), raises if it
        is alive."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if holder is None or _may_be_alive(holder):
                raise self._busy(holder) from None
            return self._watch_orphaned(fd, holder)
        except OSError as error:
            if error.errno not in _NO_FLOCK:
                raise
            holder = _read_holder(fd)
            if holder is not None and _may_be_alive(holder):
                raise self._busy(holder) from None
            return holder
        holder = _read_holder(fd)
        return holder if holder is not None and holder.pid != os.getpid() else None

    def _watch_orphaned(self, fd: int, holder: LockHolder) -> LockHolder | _Orphaned:
        """The flock is held, the holder named in the file is dead: wait ``_ORPHAN_GRACE``
        for the flock to go (ours then) or for a live run's name to appear (refused)."""
        deadline = time.monotonic() + _ORPHAN_GRACE
        while time.monotonic() < deadline:
            time.sleep(_POLL)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return holder
            except BlockingIOError:
                pass
            now = _read_holder(fd)
            if now != holder:  # a run that took the flock has written its name
                if now is None or _may_be_alive(now):
                    raise self._busy(now) from None
                holder = now
        return _Orphaned(holder)

    def _replace(self, seen: int) -> Optional[int]:
        """Put a new lock file, flocked and naming this process, where ``seen`` (the file
        a dead holder's children still lock) is; None when another run replaced it first."""
        dir_fd = os.open(self.save_dir, os.O_RDONLY)
        try:
            if not _flock_briefly(dir_fd):  # one run at a time replaces the file
                raise CheckpointError(f"cannot lock --save {self.save_dir}: another run has "
                                      f"been replacing {self.path} for 10 s")
            if not _same_file(seen, self.path):
                return None
            temporary = f"{self.path}.{os.getpid()}.tmp"
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _write(fd, _me(), temporary)
                os.replace(temporary, self.path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.remove(temporary)
                raise
            return fd
        finally:
            os.close(dir_fd)  # drops the folder's flock

    def _busy(self, holder: Optional[LockHolder]) -> CheckpointError:
        who = holder.describe() if holder is not None else "a process that has not yet " \
            "written its name"
        return CheckpointError(
            f"--save {self.save_dir} is in use by another run ({who}); two runs saving into "
            f"one folder would mix their checkpoints: give this run another --save, or stop "
            f"that run first (if it is gone and its file system has no flock, delete "
            f"{self.path})")

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


@dataclasses.dataclass(frozen=True)
class _Orphaned:
    """A dead holder whose flock is still held (by processes it started)."""

    holder: LockHolder


def _write(fd: int, holder: LockHolder, path: str) -> None:
    """Name ``holder`` in the lock file ``path`` (open as ``fd``); a full disk is a
    ``CheckpointError`` naming the file and the space."""
    text = json.dumps(dataclasses.asdict(holder)).encode() + b"\n"
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, text)
        os.fsync(fd)
    except OSError as error:
        raise CheckpointError(f"cannot lock --save: {write_failure(path, error, len(text))}"
                              ) from None


def _flock_briefly(fd: int, seconds: float = 10.0) -> bool:
    """flock ``fd``, waiting at most ``seconds`` (it is held only while a file is replaced);
    False when that ran out. A file system without flock on folders goes on without it."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL)
        except OSError as error:
            if error.errno in _NO_FLOCK:
                return True
            raise


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


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): close the inherited lock descriptors, which
    would keep the flock after the holder ends (the holder keeps its own: a flock goes only
    when every descriptor of it is closed). The child holds no lock and removes none."""
    for lock in _HELD.values():
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)

"""Files we write: their modes, and what a failed write says.

Modes: those that open() and os.mkdir() give under the umask.

``tempfile.mkstemp`` and ``tempfile.mkdtemp`` make 0600 files and 0700 folders, right for a
temporary but wrong for a result: a checkpoint folder or dataset renamed into place from such a
name would be unreadable to the user's group. ``chmod_as_created`` gives it the mode a plain
``open()``/``os.mkdir()`` would have: 0666 or 0777 less the umask (0644 / 0755 under 022).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import threading

_UMASK_LOCK = threading.Lock()


@functools.cache
def process_umask() -> int:
    """The process umask, read once. Linux shows it in /proc/self/status; elsewhere the only
    way to read it is to set it and put it back (under a lock, once per process)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def chmod_as_created(path: str) -> None:
    """Set ``path`` (a file or a folder) to the mode open() / os.mkdir() would have given it."""
    full = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, full & ~process_umask())


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged writer may still use in ``folder``'s file system."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def write_failure(path: str, cause: OSError, needed: int) -> str:
    """Why writing ``path`` failed, in one line: a full disk says how many bytes were
    ``needed`` and how many are free, the file size limit is named."""
    folder = os.path.dirname(os.path.abspath(path))
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"cannot write {path}: no space left on device ({needed} bytes needed, "
                f"{free_bytes(folder)} free in {folder})")
    if cause.errno == errno.EFBIG:
        return (f"cannot write {path}: it would pass the file size limit of this process "
                f"(ulimit -f; {needed} bytes needed)")
    return f"cannot write {path}: {cause.strerror or cause}"

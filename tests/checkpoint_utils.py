"""Damaging checkpoint files the way disks and copies do, and telling whether a folder
changed: shared by the unit, distributed and functional checkpoint tests."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import zipfile
import zlib


def flip_bytes(path: str, count: int = 2000) -> None:
    """Invert ``count`` bytes in the middle of the largest tensor stored in a torch file: the
    file keeps its size and still unpickles; only numbers change (a bad disk or copy)."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    assert info.compress_type == zipfile.ZIP_STORED and info.file_size >= count
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        start = info.header_offset + 30 + name_len + extra_len + (info.file_size - count) // 2
        f.seek(start)
        data = f.read(count)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


def folder_state(root) -> dict:
    """Every file under ``root`` by relative path, with its CRC-32."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = zlib.crc32(f.read())
    return out


@contextlib.contextmanager
def small_tmpfs(folder, size_bytes: int):
    """A tmpfs of ``size_bytes`` mounted on ``folder`` (created) for the block: a disk that
    fills up for real. Skips the test, saying why, where mounting is not allowed."""
    import pytest

    os.makedirs(folder, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root and CAP_SYS_ADMIN): "
                    f"{done.stderr.strip()}")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def resize_tmpfs(folder, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(folder)], check=True)

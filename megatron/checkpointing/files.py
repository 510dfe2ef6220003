"""Reading and writing checkpoint files: every file that matters is written whole or not at
all, and every read error names the file."""

from __future__ import annotations

import argparse
import os
import uuid
import zlib
from typing import Any, NamedTuple

import numpy as np
import torch

from megatron.checkpointing.errors import CheckpointError

_CHUNK = 16 << 20  # bytes read at a time when checksumming a file


class FileDigest(NamedTuple):
    """A file's size in bytes and its CRC-32 (zlib's polynomial) as 8 hex digits."""

    size: int
    crc32: str


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


class _ChecksummingWriter:
    """A binary file that keeps the CRC-32 and length of what passes through ``write``."""

    def __init__(self, f) -> None:
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def __getattr__(self, name: str) -> Any:  # tell, seek, ...: the file's own
        return getattr(self.f, name)


def write_torch(obj: Any, path: str) -> FileDigest:
    """``torch.save`` to ``path``, synced; returns the digest of the bytes written.

    The checksum is taken as the bytes stream out, so a large file is not read back.
    """
    with open(path, "wb") as f:
        writer = _ChecksummingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
        on_disk = os.fstat(f.fileno()).st_size
    if on_disk != writer.size:  # torch wrote out of order (it never has): read it back
        return file_digest(path)
    return FileDigest(writer.size, f"{writer.crc:08x}")


def file_digest(path: str) -> FileDigest:
    """Size and CRC-32 of the file at ``path``, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileDigest(size, f"{crc:08x}")


def _legacy_safe_globals() -> list:
    """Types Megatron(-DeepSpeed)'s own checkpoints pickle: the argparse Namespace under
    'args' and numpy's RNG state. Allowed for those files only; none runs code on load."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    return [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32)), _reconstruct,
            (_reconstruct, "numpy.core.multiarray._reconstruct")]


def read_torch(path: str, mmap: bool = False) -> dict:
    """``torch.load(weights_only=True)`` with errors that name the file.

    ``mmap``: tensors stay in the (page-cached) file until touched, so ranks that each need a
    slice of a large file read only that slice.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        with torch.serialization.safe_globals(_legacy_safe_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - zipfile, pickle and torch errors all mean "bad"
        size = os.path.getsize(path)
        raise CheckpointError(f"cannot read checkpoint file {path} ({size} bytes): it is "
                              f"truncated, corrupt or not a torch checkpoint "
                              f"({type(error).__name__}: {str(error)[:300]})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, "
                              "not a dict")
    return state

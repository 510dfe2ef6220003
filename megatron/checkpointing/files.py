"""Reading and writing checkpoint files: every file that matters is written whole or not at
all, every read error names the file, and a full disk is named as such (with the bytes needed
and free) and leaves no partial file behind.

``write_torch_streamed`` writes a file ``torch.load`` reads like any other, whose large
tensors are produced one at a time while it is written (the distributed optimizer's state,
gathered piece by piece), so the whole object never exists in memory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import pickle
import sys
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.platform.file_modes import write_failure

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
    """Write ``text`` to a temporary name beside ``path``, sync it, and rename it into place;
    a failure removes the temporary file."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with _writing(tmp, lambda: len(text.encode())):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error`` (torch wraps a failed write in a RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def _writing(path: str, size: Callable[[], int]):
    """Around writing the file ``path``: on any failure the partial file is removed, and a
    full disk (or the file size limit) becomes a ``CheckpointError`` that names the file and
    says how much was needed (``size()``) and is free."""
    try:
        yield
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(path)
        cause = _os_error_in(error)
        if cause is None:
            raise
        raise write_error(path, cause, size()) from error


def write_error(path: str, cause: OSError, needed: int) -> CheckpointError:
    """The error of a failed write of ``path`` (``file_modes.write_failure``'s line)."""
    return CheckpointError(write_failure(path, cause, needed))


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages inside ``obj`` (dicts, lists, tuples)."""
    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(obj)
    return sum(seen.values())


class _ChecksummingWriter:
    """A binary file that keeps the CRC-32 and length of what passes through ``write``."""

    def __init__(self, f) -> None:
        self.f, self.crc, self.size = f, 0, 0
        self.error: Optional[OSError] = None  # a failed write (torch's writer hides it)

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        try:
            return self.f.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name: str) -> Any:  # tell, seek, ...: the file's own
        return getattr(self.f, name)


def write_torch(obj: Any, path: str) -> FileDigest:
    """``torch.save`` to ``path``, synced; returns the digest of the bytes written.

    The checksum is taken as the bytes stream out, so a large file is not read back.
    """
    with _writing(path, lambda: tensor_bytes(obj)):
        with open(path, "wb") as f:
            writer = _ChecksummingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
            on_disk = os.fstat(f.fileno()).st_size
    if on_disk != writer.size:  # torch wrote out of order (it never has): read it back
        return file_digest(path)
    return FileDigest(writer.size, f"{writer.crc:08x}")


class Deferred:
    """A tensor of ``write_torch_streamed``'s object whose values come later, from its
    ``tensors`` iterator, in the order of ``index`` (0, 1, ...)."""

    def __init__(self, index: int, shape: tuple[int, ...],
                 dtype: torch.dtype = torch.float32) -> None:
        self.index, self.shape, self.dtype = index, tuple(shape), dtype
        self.numel = 1
        for n in self.shape:
            self.numel *= n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __reduce_ex__(self, protocol: int):
        # What a contiguous CPU tensor pickles to inside torch.save: its storage goes to
        # persistent_id, the rest rebuilds the view.
        stride, step = [], 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= n
        # Fresh tuples, as each tensor's own: a shared one would pickle as a memo reference.
        return (torch._utils._rebuild_tensor_v2,
                (_DeferredStorage(self), 0, tuple(list(self.shape)), tuple(reversed(stride)),
                 False, collections.OrderedDict()))


class _DeferredStorage(NamedTuple):
    tensor: Deferred


def _storage_record(dtype: torch.dtype, key: str, numel: int) -> tuple:
    storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    return ("storage", storage_type, key, "cpu", numel)


def _pickle_with_storages(obj: Any, first_key: int) -> tuple[bytes, list]:
    """``obj`` pickled as torch.save pickles it, each ``Deferred`` under its own index as
    storage key and every real tensor storage under ``first_key``, ``first_key + 1``, ...;
    returns the pickle and the real storages in key order."""
    real: dict[Any, tuple[str, torch.UntypedStorage]] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, value: Any):
            if isinstance(value, _DeferredStorage):
                d = value.tensor
                return _storage_record(d.dtype, str(d.index), d.numel)
            if isinstance(value, torch.storage.TypedStorage):
                untyped = value._untyped_storage
                if untyped.device.type != "cpu":
                    untyped = untyped.cpu()
                key, _ = real.setdefault(value._cdata, (str(first_key + len(real)), untyped))
                return _storage_record(value.dtype, key, value._size())
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue(), [storage for _, storage in sorted(
        real.values(), key=lambda item: int(item[0]))]


def write_torch_streamed(obj: Any, path: str, deferred: list[Deferred],
                         tensors: Iterable[torch.Tensor]) -> FileDigest:
    """Write ``obj`` to ``path`` as ``torch.save`` would, where each ``Deferred`` inside it
    (``deferred``, indexed 0..n-1) takes the next tensor of ``tensors`` (CPU, contiguous,
    of its shape and dtype). One tensor of ``tensors`` is in memory at a time. If writing
    fails, the rest of ``tensors`` is still drawn (they may be collectives the other ranks
    take part in) before the error is raised. Returns the digest of the bytes written."""
    stream = iter(tensors)
    size = lambda: sum(d.nbytes for d in deferred) + tensor_bytes(obj)  # noqa: E731
    try:
        with _writing(path, size):
            with open(path, "wb") as f:
                writer = _ChecksummingWriter(f)
                _write_records(obj, writer, deferred, stream)
                f.flush()
                os.fsync(f.fileno())
    except Exception:
        with contextlib.suppress(Exception):  # a stream that failed itself ends at once
            for _ in stream:
                pass
        raise
    return FileDigest(writer.size, f"{writer.crc:08x}")


def _write_records(obj: Any, writer: Any, deferred: list[Deferred],
                   stream: Iterator[torch.Tensor]) -> None:
    data, real = _pickle_with_storages(obj, len(deferred))
    alignment = str(getattr(torch.serialization, "_get_storage_alignment", lambda: 64)())
    with torch.serialization._open_zipfile_writer(writer) as zip_file:
        zip_file.write_record("data.pkl", data, len(data))
        zip_file.write_record(".format_version", "1", 1)
        zip_file.write_record(".storage_alignment", alignment, len(alignment))
        zip_file.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for d in deferred:
            tensor = next(stream)
            if tuple(tensor.shape) != d.shape or tensor.dtype != d.dtype:
                raise ValueError(f"streamed tensor {d.index} is {tuple(tensor.shape)} "
                                 f"{tensor.dtype}, expected {d.shape} {d.dtype}")
            tensor = tensor.detach().cpu()
            if (not tensor.is_contiguous() or tensor.storage_offset() != 0
                    or tensor.untyped_storage().nbytes() != d.nbytes):
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            zip_file.write_record(f"data/{d.index}", tensor.untyped_storage(), d.nbytes)
        for offset, storage in enumerate(real):
            zip_file.write_record(f"data/{len(deferred) + offset}", storage, storage.nbytes())


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

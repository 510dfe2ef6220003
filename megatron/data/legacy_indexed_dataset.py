"""Megatron's legacy indexed datasets, ``--data-impl lazy`` and ``cached``: read, write, convert.

The pre-2020 pair that Megatron-DeepSpeed still writes with ``--dataset-impl lazy|cached``
(fairseq's format). Both impls share one file layout; they differ only in how they read:
``lazy`` reads each sequence from the ``.bin`` when it is asked for, ``cached`` reads the
whole ``.bin`` into memory when the dataset opens. Little-endian::

    .idx  field                         type
          magic                         8 bytes  b"TNTIDX\\x00\\x00"
          version                       uint64   1
          dtype code, element size      uint64 x 2  (codes as in the mmap format; size in bytes)
          len, sizes count              uint64 x 2  n items, s entries of ``sizes``
          doc count                     uint64   d  (absent in fairseq's original files)
          dim_offsets                   int64[n + 1]  where each item's shape starts in sizes
          data_offsets                  int64[n + 1]  where each item starts in .bin, in elements
          sizes                         int64[s]      every dimension of every item
          doc_idx                       int64[d]      item index where each document starts
    .bin  the elements of all items back to back

Token datasets hold 1-D items, so ``s == n`` and ``sizes`` are the token counts; an index with
multi-dimensional items is refused by name. Without the doc section each item is one document.
Files are written as Megatron-DeepSpeed writes them (int32 elements) under temporary names and
renamed when complete. ``tools/convert_legacy_dataset.py`` turns a pair into the mmap format.

No torch import, as in ``indexed_dataset``.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Any, Optional, Union

import numpy as np

from megatron.data.index_format import (
    DTYPE_CODES,
    LEGACY_MAGIC,
    IndexedDatasetError,
    as_numpy,
    data_file_path,
    dtype_code,
    index_file_path,
)

LEGACY_IMPLS = ("lazy", "cached")
_HEAD = 8 + 8 + 16 + 16  # magic, version, (code, element size), (len, sizes count)


def is_legacy_index(idx_path: str) -> bool:
    """Whether ``idx_path`` starts with the legacy magic."""
    with open(idx_path, "rb") as f:
        return f.read(8) == LEGACY_MAGIC


class LegacyIndex:
    """The parsed legacy ``.idx``: ``sizes`` (int32[n] tokens per item), ``data_offsets``
    (int64[n + 1], in elements), ``doc_idx`` (int64[d]) and the element ``dtype``."""

    def __init__(self, idx_path: str) -> None:
        self.path = idx_path
        with open(idx_path, "rb") as f:
            raw = f.read()
        if len(raw) < _HEAD or raw[:8] != LEGACY_MAGIC:
            raise IndexedDatasetError(f"{idx_path}: not a legacy lazy/cached index (magic "
                                      f"{raw[:8]!r}, expected {LEGACY_MAGIC!r})")
        (version,) = struct.unpack("<Q", raw[8:16])
        if version != 1:
            raise IndexedDatasetError(f"{idx_path}: unknown legacy index version {version}")
        code, self.element_size = struct.unpack("<QQ", raw[16:32])
        n, s = struct.unpack("<QQ", raw[32:48])
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        if code == 6:  # legacy code 6 is numpy's float (float64); 7 is double
            self.dtype = np.dtype(np.float64)
        if code == 7:
            self.dtype = np.dtype(np.float64)
        if self.element_size != self.dtype.itemsize:
            raise IndexedDatasetError(f"{idx_path}: element size {self.element_size} does not "
                                      f"match dtype code {code} ({self.dtype})")
        arrays = _read_arrays(idx_path, raw, n, s)
        dim_offsets, self.data_offsets, sizes, self.doc_idx = arrays
        if not np.array_equal(np.diff(dim_offsets), np.ones(n, dtype=np.int64)) or s != n:
            raise IndexedDatasetError(f"{idx_path}: items with more than one dimension; only "
                                      "token sequences (1-D items) are supported")
        if not np.array_equal(np.diff(self.data_offsets), sizes):
            raise IndexedDatasetError(f"{idx_path}: data offsets do not advance by the sizes")
        self.sizes = sizes.astype(np.int32)

    def __len__(self) -> int:
        return len(self.sizes)


def _read_arrays(idx_path: str, raw: bytes, n: int, s: int):
    """dim_offsets, data_offsets, sizes, doc_idx; doc_idx is arange(n + 1) when absent."""
    without_docs = _HEAD + 8 * (2 * (n + 1) + s)
    if len(raw) == without_docs:  # fairseq's original layout: no doc count, no doc_idx
        d, start = None, _HEAD
    elif len(raw) >= _HEAD + 8:
        (d,) = struct.unpack("<Q", raw[_HEAD:_HEAD + 8])
        start = _HEAD + 8
        if len(raw) != start + 8 * (2 * (n + 1) + s + d):
            raise IndexedDatasetError(
                f"{idx_path}: file is {len(raw)} bytes but its header ({n} items, {s} sizes, "
                f"{d} documents) needs {start + 8 * (2 * (n + 1) + s + d)}")
    else:
        raise IndexedDatasetError(f"{idx_path}: truncated header")
    longs = np.frombuffer(raw, dtype="<i8", offset=start)
    dim_offsets, data_offsets = longs[:n + 1], longs[n + 1:2 * n + 2]
    sizes = longs[2 * n + 2:2 * n + 2 + s]
    doc_idx = longs[2 * n + 2 + s:] if d is not None else np.arange(n + 1, dtype=np.int64)
    return dim_offsets, data_offsets, sizes, doc_idx


class LegacyIndexedDataset:
    """``--data-impl lazy``: a legacy pair read one sequence at a time from the ``.bin``
    (``cached=True``: ``--data-impl cached``, the whole ``.bin`` in memory from the start).

    Offers what the GPT dataset uses of ``MMapIndexedDataset``: ``len``, ``[i]``, ``get``,
    ``sizes``, ``doc_idx``, ``dtype``. Pickles by path.
    """

    def __init__(self, path_prefix: str, cached: bool = False) -> None:
        self._open(path_prefix, cached)

    def _open(self, path_prefix: str, cached: bool) -> None:
        self._path, self._cached = path_prefix, cached
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for p, what in ((idx_path, ".idx"), (bin_path, ".bin")):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p}: missing {what} file of dataset prefix "
                                          f"{path_prefix!r}")
        self._index = LegacyIndex(idx_path)
        need = int(self._index.data_offsets[-1]) * self._index.element_size
        if os.path.getsize(bin_path) != need:
            raise IndexedDatasetError(f"{bin_path}: file is {os.path.getsize(bin_path)} bytes "
                                      f"but {idx_path} describes {need}")
        self._data: Optional[np.ndarray] = None
        self._fd: Optional[int] = None
        if cached:
            self._data = np.fromfile(bin_path, dtype=self.dtype)

    def __getstate__(self) -> tuple[str, bool]:
        return self._path, self._cached

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self._open(*state)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx``."""
        i = int(idx) + (len(self) if int(idx) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {idx} out of range for {self._path} ({len(self)})")
        size = int(self._index.sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of "
                             f"{self._path} ({size} tokens)")
        start = int(self._index.data_offsets[i]) + offset
        if self._data is not None:
            return self._data[start:start + length]
        if self._fd is None:  # opened on first use: each DataLoader worker has its own
            self._fd = os.open(data_file_path(self._path), os.O_RDONLY)
        size = self._index.element_size
        raw = os.pread(self._fd, length * size, start * size)
        return np.frombuffer(raw, dtype=self.dtype, count=length)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def path_prefix(self) -> str:
        return self._path

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(
            data_file_path(path_prefix))

    def close(self) -> None:
        self._data = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


class LegacyIndexedDatasetBuilder:
    """Writes a legacy pair; the interface of ``MMapIndexedDatasetBuilder`` (``add_item``,
    ``end_document``, ``add_doc``, ``merge_file_``, ``finalize``, ``abort``)."""

    def __init__(self, out_file_bin: str, dtype: Any = np.int32, atomic: bool = True) -> None:
        self._dtype = np.dtype(dtype)
        self._code = dtype_code(self._dtype)
        self._bin_path = out_file_bin
        self._bin_tmp = out_file_bin + ".tmp" if atomic else out_file_bin
        self._file = open(self._bin_tmp, "wb", buffering=8 << 20)
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _write(self, tokens: np.ndarray) -> None:
        if tokens.size and np.issubdtype(tokens.dtype, np.integer):
            info = np.iinfo(self._dtype)
            if int(tokens.min()) < info.min or int(tokens.max()) > info.max:
                raise ValueError(f"token ids do not fit {self._dtype} of {self._bin_path}")
        self._file.write(np.ascontiguousarray(tokens, dtype=self._dtype).tobytes())

    def add_item(self, item: Any) -> None:
        tokens = as_numpy(item)
        self._write(tokens)
        self._sizes.append(int(tokens.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_doc(self, tokens: Any, sentence_lengths: Any) -> None:
        tokens = as_numpy(tokens)
        lengths = [int(n) for n in np.asarray(sentence_lengths).reshape(-1)]
        if sum(lengths) != tokens.size:
            raise ValueError(f"add_doc: sentence lengths sum to {sum(lengths)} but the "
                             f"document has {tokens.size} tokens")
        self._write(tokens)
        self._sizes.extend(lengths)
        self.end_document()

    def merge_file_(self, another_prefix: str) -> None:
        """Append every item and document of the legacy dataset at ``another_prefix``."""
        other = LegacyIndexedDataset(another_prefix)
        offset = len(self._sizes)
        for i in range(len(other)):
            self.add_item(other.get(i))
        self._doc_idx.extend(int(d) + offset for d in other.doc_idx[1:])

    def finalize(self, index_file: str) -> None:
        self._file.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        data_offsets = np.concatenate(([0], np.cumsum(sizes))).astype("<i8")
        tmp_idx = index_file + ".tmp"
        with open(tmp_idx, "wb") as f:
            f.write(LEGACY_MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<QQ", self._code, self._dtype.itemsize))
            f.write(struct.pack("<QQ", len(sizes), len(sizes)))
            f.write(struct.pack("<Q", len(self._doc_idx)))
            f.write(np.arange(len(sizes) + 1, dtype="<i8").tobytes())  # dim_offsets: 1-D items
            f.write(data_offsets.tobytes())
            f.write(sizes.astype("<i8").tobytes())
            f.write(np.asarray(self._doc_idx, dtype="<i8").tobytes())
        if self._bin_tmp != self._bin_path:
            if os.path.exists(index_file):
                os.remove(index_file)
            os.replace(self._bin_tmp, self._bin_path)
        os.replace(tmp_idx, index_file)

    def abort(self) -> None:
        if not self._file.closed:
            with contextlib.suppress(OSError):
                self._file.close()
        if self._bin_tmp != self._bin_path and os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)


def append_to_builder(source: LegacyIndexedDataset, builder: Any) -> None:
    """Append every sequence and document of ``source`` to ``builder`` (an mmap
    ``MMapIndexedDatasetBuilder``), as the mmap builder's
    ``merge_file_`` appends an mmap pair (items after the last document end stay outside any
    document)."""
    doc_idx = source.doc_idx
    for d in range(len(doc_idx) - 1):
        for i in range(int(doc_idx[d]), int(doc_idx[d + 1])):
            builder.add_item(source.get(i))
        builder.end_document()
    for i in range(int(doc_idx[-1]), len(source)):  # items after the last document end
        builder.add_item(source.get(i))


__all__ = ["LEGACY_IMPLS", "LEGACY_MAGIC", "LegacyIndex", "LegacyIndexedDataset",
           "LegacyIndexedDatasetBuilder", "append_to_builder",
           "is_legacy_index"]

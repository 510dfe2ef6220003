"""Megatron's memory-mapped indexed dataset: a ``.bin`` of token ids and an ``.idx`` index.

On-disk layout (little-endian, identical to Megatron-LM and Megatron-DeepSpeed ``mmap``)::

    .idx  offset  field
          0       magic           9 bytes  b"MMIDIDX\\x00\\x00"
          9       version         uint64   always 1
          17      dtype code      uint8    see DTYPE_CODES
          18      sequence count  uint64   n
          26      document count  uint64   d  (= number of documents + 1)
          34      sizes           int32[n]  tokens per sequence
          34+4n   pointers        int64[n]  byte offset of each sequence in .bin
          34+12n  doc_idx         int64[d]  sequence index where each document starts;
                                            doc_idx[0] = 0, one more entry per end_document()
    .bin  the token ids of all sequences back to back, in the dtype of the code

Crash safety of the builder: the ``.bin`` is written under ``<bin>.tmp`` and the ``.idx``
under ``<idx>.tmp``.  ``finalize`` first removes any old ``.idx`` of the same name, then renames
the ``.bin`` into place and the ``.idx`` last.  So an interrupted run leaves either the previous
complete pair, only ``*.tmp`` files, or a ``.bin`` without ``.idx`` (which the reader refuses
with "missing .idx"); never a valid-looking truncated pair.

This module must not import torch: the preprocessing tool imports it in many worker
processes.  Torch tensors are still accepted by ``add_item`` through duck typing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from typing import Any, Optional, Union

import numpy as np

from megatron.data import index_checks
from megatron.data import legacy_indexed_dataset as legacy
from megatron.data.index_checks import (  # the reader's API too
    UncountedEod,
    find_uncounted_eod,
    index_problems,
    layout_problems,
    sequences_end,
)
from megatron.data.index_format import (  # the reader's and builder's API too
    DTYPE_CODES,
    LEGACY_MAGIC,
    DTypeLike,
    IndexedDatasetError,
    as_numpy,
    data_file_path,
    dtype_code,
    index_file_path,
)

logger = logging.getLogger(__name__)

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # 34 bytes: magic, version, dtype code, n, d

def best_fitting_dtype(vocab_size: Optional[int] = None) -> np.dtype:
    """uint16 when every token id fits (vocab < 65500, Megatron's threshold), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _read_header(idx_path: str) -> tuple[int, int, int]:
    """Validate the fixed header of ``idx_path``; returns (dtype code, n sequences, d docs)."""
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head[:8] == LEGACY_MAGIC[:8] and head[:9] != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: this is Megatron's legacy 'lazy'/'cached' index format (magic "
            f"{LEGACY_MAGIC!r}); open it with --data-impl lazy, cached or infer, or convert it "
            "with tools/convert_legacy_dataset.py")
    if len(head) < 9 or head[:9] != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: bad magic {head[:9]!r}, expected {INDEX_MAGIC!r} (not an mmap .idx file)")
    if len(head) < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{idx_path}: truncated header ({len(head)} bytes, expected {HEADER_SIZE})")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != INDEX_VERSION:
        raise IndexedDatasetError(f"{idx_path}: unknown version {version}, expected 1")
    code = head[17]
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(
            f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
    n, d = struct.unpack("<QQ", head[18:34])
    return code, n, d


def _resolve_code_7(idx_path: str, sizes: np.ndarray, pointers: np.ndarray,
                    bin_bytes: Optional[int]) -> np.dtype:
    """Code 7 means float32 (Megatron-LM) or float64 (old Megatron-DeepSpeed): ask the data."""
    tokens = int(sizes.sum(dtype=np.int64))
    if len(sizes) > 1 and sizes[0] > 0:
        itemsize = int(pointers[1] - pointers[0]) // int(sizes[0])
    elif bin_bytes is not None and tokens > 0:
        itemsize = bin_bytes // tokens
    else:
        itemsize = 4
    if itemsize not in (4, 8):
        raise IndexedDatasetError(f"{idx_path}: dtype code 7 with {itemsize}-byte items")
    return np.dtype(np.float32 if itemsize == 4 else np.float64)


class MMapIndex:
    """The parsed ``.idx`` file: ``sizes`` (int32[n]), ``pointers`` (int64[n]),
    ``doc_idx`` (int64[d]) and the token ``dtype``; arrays are read-only views of the mmap."""

    def __init__(self, idx_path: str, skip_warmup: bool = True,
                 bin_bytes: Optional[int] = None) -> None:
        self.path = idx_path
        code, n, d = _read_header(idx_path)
        file_bytes = os.path.getsize(idx_path)
        need = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if file_bytes < need:
            raise IndexedDatasetError(
                f"{idx_path}: file is {file_bytes} bytes but its header ({n} sequences, {d} "
                f"document-index entries) needs {need}; the .idx is truncated")
        if not skip_warmup:
            _warmup(idx_path)
        self._mmap = np.memmap(idx_path, mode="r", order="C") if file_bytes else None
        buf = memoryview(self._mmap) if self._mmap is not None else b""
        self.sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
        self.dtype = DTYPE_CODES[code]
        self.code = code
        if code == 7:
            self.dtype = _resolve_code_7(idx_path, self.sizes, self.pointers, bin_bytes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> tuple[int, int]:
        """(byte pointer into .bin, number of tokens) of sequence i."""
        return int(self.pointers[i]), int(self.sizes[i])

    def close(self) -> None:
        self.sizes = self.pointers = self.doc_idx = None
        if self._mmap is not None:
            self._mmap._mmap.close()
            self._mmap = None


def _warmup(path: str) -> None:
    """Read a file once so that its pages are in the OS cache before training starts."""
    with open(path, "rb") as f:
        while f.read(100 * 1024 * 1024):
            pass


# ----------------------------------------------------------------------------------------------
# Checks at open (index_checks) and Megatron-DeepSpeed's --append-eod index
# ----------------------------------------------------------------------------------------------


def verify_index(index: MMapIndex, bin_path: str, bin_bytes: int) -> Optional[UncountedEod]:
    """Raise IndexedDatasetError listing ``index_problems`` when there are any; else return
    the pair's Megatron-DeepSpeed --append-eod quirk, or None for a pair without it."""
    problems = index_checks.index_problems(index, bin_path, bin_bytes)
    if problems:
        raise IndexedDatasetError("; ".join(problems) + " (tools/inspect_dataset.py --check "
                                  "shows the dataset)")
    return index_checks.uncounted_eod_of_sound_pair(index, bin_path, bin_bytes)


def uncounted_eod_message(prefix: str, quirk: UncountedEod) -> str:
    """The one warning a Megatron-DeepSpeed --append-eod pair gets: the quirk and its fix."""
    return (f"{index_file_path(prefix)} is Megatron-DeepSpeed's preprocess_data.py --append-eod "
            f"index: its sizes leave out the EOD (id {quirk.eod}) that ends each of its "
            f"{quirk.documents} non-empty documents in {data_file_path(prefix)}. It is read as "
            "Megatron-DeepSpeed reads it, so samples equal Megatron-DeepSpeed's: document k "
            "starts k tokens before where it was written and ends that much short. To read "
            "every document as written, rewrite the index once: python "
            f"tools/inspect_dataset.py --fix-eod-index {prefix}")


# Pairs warned about in this process, by path and version: a run opens each dataset more than
# once (the start-up checks, then the dataset builders), and says it once.
_warned_uncounted_eod: set[tuple[str, int, int]] = set()


def _warn_uncounted_eod(prefix: str, quirk: UncountedEod) -> None:
    idx = index_file_path(prefix)
    st = os.stat(idx)
    key = (os.path.abspath(idx), st.st_size, st.st_mtime_ns)
    if key not in _warned_uncounted_eod:
        _warned_uncounted_eod.add(key)
        logger.warning(uncounted_eod_message(prefix, quirk))


class MMapIndexedDataset:
    """Read-only view of a ``prefix.bin`` / ``prefix.idx`` pair; sequences are numpy arrays.

    ``ds[i]`` is the i-th sequence (shares memory with the mmap), ``ds[a:b]`` a list of them.
    Pickles by path, so DataLoader workers re-open their own mmaps.
    """

    Index = MMapIndex

    def __init__(self, path_prefix: str, skip_warmup: bool = True, verify: bool = True,
                 in_memory: bool = False) -> None:
        self._open(path_prefix, skip_warmup, verify, in_memory)

    def _open(self, path_prefix: str, skip_warmup: bool, verify: bool,
              in_memory: bool = False) -> None:
        self._path, self._in_memory = path_prefix, in_memory
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for p, what in ((idx_path, ".idx"), (bin_path, ".bin")):
            if not os.path.isfile(p):
                raise IndexedDatasetError(
                    f"{p}: missing {what} file of dataset prefix {path_prefix!r} (the prefix "
                    "must be the path without .bin/.idx)")
        bin_bytes = os.path.getsize(bin_path)
        self._index = MMapIndex(idx_path, skip_warmup, bin_bytes)
        if verify:
            quirk = verify_index(self._index, bin_path, bin_bytes)
            if quirk is not None:
                _warn_uncounted_eod(path_prefix, quirk)
        if not skip_warmup:
            _warmup(bin_path)
        self._bin_mmap = None
        if in_memory:  # --in-memory: the tokens in RAM, read once
            with open(bin_path, "rb") as f:
                self._bin = f.read()
        else:
            self._bin_mmap = np.memmap(bin_path, mode="r", order="C") if bin_bytes else None
            self._bin = memoryview(self._bin_mmap) if self._bin_mmap is not None else b""

    def __getstate__(self) -> tuple[str, bool]:
        return self._path, self._in_memory

    def __setstate__(self, state: tuple[str, bool]) -> None:
        # Verified when the pickling process opened it; DataLoader workers only re-open.
        self._open(state[0], skip_warmup=True, verify=False, in_memory=state[1])

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an indexed dataset must be contiguous (step 1)")
            if stop <= start:
                return []
            sizes = self._index.sizes[start:stop]
            flat = self._read(int(self._index.pointers[start]), int(sizes.sum(dtype=np.int64)))
            return np.split(flat, np.cumsum(sizes)[:-1])
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (to its end if length is None)."""
        n = len(self)
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {idx} out of range for {self._path} ({n} sequences)")
        ptr, size = self._index[i]
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of "
                             f"{self._path} ({size} tokens)")
        return self._read(ptr + offset * self.dtype.itemsize, length)

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=self.dtype)
        return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_offset)

    @property
    def sizes(self) -> np.ndarray:
        """int32[n]: tokens per sequence."""
        return self._index.sizes

    def size(self, index: int) -> int:
        return int(self._index.sizes[index])

    @property
    def pointers(self) -> np.ndarray:
        """int64[n]: byte offset of each sequence in the .bin."""
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """int64[documents + 1]: sequence index where each document starts, then n."""
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def set_doc_idx(self, doc_idx: np.ndarray) -> None:
        self._index.doc_idx = doc_idx

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def path_prefix(self) -> str:
        return self._path

    @property
    def index(self) -> MMapIndex:
        return self._index

    def problems(self) -> list[str]:
        """``index_problems`` of this pair (for a dataset opened with ``verify=False``)."""
        bin_path = data_file_path(self._path)
        return index_checks.index_problems(self._index, bin_path, os.path.getsize(bin_path))

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(
            data_file_path(path_prefix))

    def close(self) -> None:
        self._bin = None
        if self._bin_mmap is not None:
            self._bin_mmap._mmap.close()
            self._bin_mmap = None
        self._index.close()


def make_dataset(path: str, impl: str = "mmap", skip_warmup: bool = True,
                 in_memory: bool = False) -> Any:
    """Open ``path`` (a prefix) as ``--data-impl`` ``impl``: 'mmap', the legacy 'lazy' or
    'cached', or 'infer' (the format the .idx's magic names). ``in_memory`` reads an mmap
    dataset's tokens into RAM."""
    if impl not in ("mmap", "infer", *legacy.LEGACY_IMPLS):
        raise IndexedDatasetError(f"--data-impl {impl!r} cannot open {path}: a .bin/.idx "
                                  "prefix is 'mmap', 'lazy', 'cached' or 'infer'")
    idx = index_file_path(path)
    if impl == "infer" and os.path.isfile(idx) and legacy.is_legacy_index(idx):
        impl = "lazy"
    if impl in legacy.LEGACY_IMPLS:
        return legacy.LegacyIndexedDataset(path, cached=impl == "cached" or in_memory)
    return MMapIndexedDataset(path, skip_warmup, in_memory=in_memory)


def dataset_exists(path: str, impl: str = "mmap") -> bool:
    return MMapIndexedDataset.exists(path)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


class _GrowableArray:
    """An int64 array with amortised O(1) append and vectorised extend."""

    def __init__(self, initial: int = 1 << 12) -> None:
        self._data = np.empty(initial, dtype=np.int64)
        self._len = 0

    def _reserve(self, extra: int) -> None:
        need = self._len + extra
        if need > len(self._data):
            grown = np.empty(max(need, 2 * len(self._data)), dtype=np.int64)
            grown[: self._len] = self._data[: self._len]
            self._data = grown

    def append(self, value: int) -> None:
        self._reserve(1)
        self._data[self._len] = value
        self._len += 1

    def extend(self, values: np.ndarray) -> None:
        self._reserve(len(values))
        self._data[self._len : self._len + len(values)] = values
        self._len += len(values)

    def __len__(self) -> int:
        return self._len

    def view(self) -> np.ndarray:
        return self._data[: self._len]


class MMapIndexedDatasetBuilder:
    """Writes a ``.bin`` / ``.idx`` pair; sequences go straight to a buffered file.

    Call ``add_item`` per sequence (sentence) and ``end_document`` after each document, or
    ``add_doc`` for a whole document at once; ``finalize(idx_path)`` makes the pair visible.
    With ``atomic=True`` (default) the data goes to ``<out_file_bin>.tmp`` until ``finalize``
    (see the module docstring); ``abort()`` removes the temporary files.
    """

    def __init__(self, out_file_bin: str, dtype: DTypeLike = np.int64, atomic: bool = True,
                 buffer_bytes: int = 8 << 20) -> None:
        self._dtype = np.dtype(dtype)
        self._code = dtype_code(self._dtype)
        self._bin_path = out_file_bin
        self._bin_tmp = out_file_bin + ".tmp" if atomic else out_file_bin
        self._file = open(self._bin_tmp, "wb", buffering=buffer_bytes)
        self._sizes = _GrowableArray()
        self._doc_idx = _GrowableArray()
        self._doc_idx.append(0)
        if np.issubdtype(self._dtype, np.integer):
            info = np.iinfo(self._dtype)
            self._range = (int(info.min), int(info.max))
        else:
            self._range = None

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _write_tokens(self, tokens: np.ndarray) -> None:
        if tokens.dtype != self._dtype:
            self._check_range(tokens)
            tokens = tokens.astype(self._dtype)
        self._file.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))

    def _check_range(self, tokens: np.ndarray) -> None:
        # A silent wrap of id 70000 into uint16 would corrupt the corpus without any sign.
        if self._range is None or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < self._range[0] or hi > self._range[1]:
            raise ValueError(
                f"token ids in [{lo}, {hi}] do not fit the dataset dtype {self._dtype} of "
                f"{self._bin_path}; pass a larger vocab_size / dtype to the builder")

    def add_item(self, item: Any) -> None:
        """Append one sequence (numpy array, list of ints or torch tensor)."""
        tokens = as_numpy(item)
        self._write_tokens(tokens)
        self._sizes.append(tokens.size)

    def add_doc(self, tokens: Any, sentence_lengths: Any) -> None:
        """Append a whole document: its tokens back to back, split into the given sentences."""
        tokens = as_numpy(tokens)
        lengths = np.asarray(sentence_lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"add_doc: sentence lengths sum to {int(lengths.sum())} but the "
                             f"document has {tokens.size} tokens")
        self._write_tokens(tokens)
        self._sizes.extend(lengths)
        self._doc_idx.append(len(self._sizes))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    add_document = add_doc  # Megatron-LM core's name

    def merge_file_(self, another_prefix: str, whole_bin: bool = False) -> None:
        """Append every sequence and document of the dataset at ``another_prefix``: the
        bytes its index covers, or with ``whole_bin`` its whole .bin (what Megatron-DeepSpeed's
        merge copies, uncounted --append-eod tokens included)."""
        other = MMapIndexedDataset(another_prefix)
        if other.dtype != self._dtype:
            raise IndexedDatasetError(
                f"{index_file_path(another_prefix)}: dtype {other.dtype} differs from the "
                f"builder's {self._dtype}; cannot merge")
        offset = len(self._sizes)
        self._sizes.extend(other.sizes)
        self._doc_idx.extend(other.doc_idx[1:] + offset)
        used = os.path.getsize(data_file_path(another_prefix)) if whole_bin \
            else sequences_end(other.index)
        other.close()
        with open(data_file_path(another_prefix), "rb") as f:
            _copy_bytes(f, self._file, used)

    add_index = merge_file_  # Megatron-LM core's name

    def finalize(self, index_file: str) -> None:
        """Close the .bin, write the .idx, and move both into place (the .idx last)."""
        self._file.close()
        sizes = self._sizes.view()
        if len(sizes) and int(sizes.max()) > np.iinfo(np.int32).max:
            raise ValueError(f"{self._bin_path}: a sequence longer than 2^31-1 tokens cannot be "
                             "indexed (sizes are int32)")
        tmp_idx = index_file + ".tmp"
        write_index(tmp_idx, self._dtype, sizes, self._doc_idx.view())
        if self._bin_tmp != self._bin_path:
            # Drop a stale .idx first: a crash between the renames must not pair it with new data.
            if os.path.exists(index_file):
                os.remove(index_file)
            os.replace(self._bin_tmp, self._bin_path)
        os.replace(tmp_idx, index_file)

    def abort(self) -> None:
        """Close and delete the partial output (only meaningful with atomic=True).

        Never raises on the close: on a full disk closing flushes the buffer and fails again,
        the file is closed all the same, and the removal is what frees the space; the error
        that led to the abort is the one to report.
        """
        if not self._file.closed:
            with contextlib.suppress(OSError):
                self._file.close()
        if self._bin_tmp != self._bin_path and os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)


def _copy_bytes(src: Any, dst: Any, count: int) -> None:
    remaining = count
    while remaining > 0:
        chunk = src.read(min(remaining, 16 << 20))
        if not chunk:
            raise IndexedDatasetError(f"{src.name}: ended {remaining} bytes early while merging")
        dst.write(chunk)
        remaining -= len(chunk)


def write_index(idx_path: str, dtype: DTypeLike, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write an .idx file for sequences of ``sizes`` tokens laid out back to back."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<QQ", len(sizes), len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.asarray(doc_idx, dtype="<i8").tobytes())


def make_builder(out_file: str, impl: str = "mmap", vocab_size: Optional[int] = None,
                 atomic: bool = True) -> Any:
    """A builder writing ``out_file`` (the .bin path): mmap in the smallest dtype for
    ``vocab_size``; the legacy 'lazy'/'cached' format in int32, as Megatron-DeepSpeed does."""
    if impl in legacy.LEGACY_IMPLS:
        return legacy.LegacyIndexedDatasetBuilder(out_file, dtype=np.int32, atomic=atomic)
    if impl != "mmap":
        raise ValueError(f"--dataset-impl {impl!r} is not supported; use mmap, lazy or cached")
    return MMapIndexedDatasetBuilder(out_file, dtype=best_fitting_dtype(vocab_size), atomic=atomic)


def merge_datasets(prefixes: list[str], out_prefix: str) -> None:
    """Concatenate datasets (same dtype) into ``out_prefix``.bin/.idx."""
    if not prefixes:
        raise ValueError("merge_datasets: no input prefixes")
    first = MMapIndexedDataset(prefixes[0])
    builder = MMapIndexedDatasetBuilder(data_file_path(out_prefix), dtype=first.dtype)
    first.close()
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
    except BaseException:
        builder.abort()
        raise
    builder.finalize(index_file_path(out_prefix))


__all__ = [
    "DTYPE_CODES", "HEADER_SIZE", "INDEX_MAGIC", "IndexedDatasetError", "MMapIndex",
    "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "UncountedEod", "best_fitting_dtype",
    "data_file_path", "dataset_exists", "dtype_code",
    "find_uncounted_eod", "index_file_path", "index_problems",
    "layout_problems", "make_builder", "make_dataset", "merge_datasets", "sequences_end",
    "uncounted_eod_message", "verify_index", "write_index",
]

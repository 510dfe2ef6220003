"""Flat token files as training data: ``--data-impl flat`` and ``--data-impl npy``.

Three layouts users bring from nanoGPT-style projects, read in place (memory-mapped, or into
RAM with ``--in-memory``):

- ``flat``: nanoGPT's ``prepare.py`` output, ``train.bin`` / ``val.bin``: the token ids back to
  back as raw uint16, no header. A ``.bin`` that starts with llm.c's shard header (256 int32,
  magic 20240520, version 1 = uint16 / 2 = uint32 tokens, token count; the FineWeb shards of
  llm.c and modded-nanogpt, ``fineweb_train_000001.bin``) is read after its 1024-byte header.
- ``npy``: FineWeb-style shards saved with ``numpy.save`` (build-nanogpt's
  ``edufineweb_train_000001.npy``): one 1-D integer array per file.

A data path is a file, a glob, or a folder. A folder whose files are named ``*train*`` and
``*val*`` (nanoGPT's and the FineWeb scripts' names) gives the training split its train files
and the validation split its val files, and has no test split; any other source is one token
stream (its files in sorted order) cut by ``--split`` into train, valid and test *by tokens*.

Each split becomes an indexed-dataset-like ``TokenSpans`` (pieces of at most ``PIECE_TOKENS``
tokens, each a "document") under the ordinary ``GPTDataset``: samples are contiguous windows of
``seq_length + 1`` tokens (consecutive windows share one token, as in Megatron), served in a
seeded shuffled order, resumable from the consumed-sample count, cached in the index cache and
blendable with weights like any ``--data-path``. Only a window that crosses the end of a piece
(one per 2^30 tokens, or one per file) joins tokens that are not neighbours in the files.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron.data.dataset_utils import DataConfigError, get_train_valid_test_split_, log_rank0

TOKEN_FILE_IMPLS = ("flat", "npy")
LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
FLAT_DTYPE = np.dtype("<u2")  # nanoGPT's prepare.py writes uint16
PIECE_TOKENS = 1 << 30  # sizes and offsets of the sample index are int32


@dataclass(frozen=True)
class TokenFile:
    """One token file: ``count`` tokens of ``dtype`` starting at byte ``offset``."""

    path: str
    offset: int
    count: int
    dtype: np.dtype

    def read(self, in_memory: bool) -> np.ndarray:
        if in_memory:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                return np.fromfile(f, dtype=self.dtype, count=self.count)
        if self.count == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset,
                         shape=(self.count,))


def open_token_file(path: str, impl: str) -> TokenFile:
    """The layout of ``path`` as ``--data-impl impl``; errors name the file."""
    if not os.path.isfile(path):
        raise DataConfigError(f"{path}: no such token file (--data-impl {impl})")
    if impl == "npy":
        return _npy_file(path)
    size = os.path.getsize(path)
    head = np.fromfile(path, dtype="<i4", count=3) if size >= LLMC_HEADER_BYTES else None
    if head is not None and int(head[0]) == LLMC_MAGIC:
        return _llmc_file(path, size, int(head[1]), int(head[2]))
    if size % FLAT_DTYPE.itemsize:
        raise DataConfigError(f"{path}: {size} bytes is not a whole number of uint16 tokens; "
                              "not a nanoGPT-style flat token file")
    return TokenFile(path, 0, size // FLAT_DTYPE.itemsize, FLAT_DTYPE)


def _llmc_file(path: str, size: int, version: int, count: int) -> TokenFile:
    if version not in LLMC_DTYPES:
        raise DataConfigError(f"{path}: llm.c shard header version {version}, expected 1 "
                              "(uint16) or 2 (uint32)")
    dtype = LLMC_DTYPES[version]
    if size != LLMC_HEADER_BYTES + count * dtype.itemsize:
        raise DataConfigError(f"{path}: the llm.c header says {count} tokens but the file "
                              f"holds {(size - LLMC_HEADER_BYTES) / dtype.itemsize:g}; "
                              "truncated?")
    return TokenFile(path, LLMC_HEADER_BYTES, count, dtype)


def _npy_file(path: str) -> TokenFile:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataConfigError(f"{path}: not a readable .npy file ({e})") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataConfigError(f"{path}: a token shard must be a 1-D integer array, found "
                              f"shape {array.shape} of {array.dtype}")
    return TokenFile(path, int(array.offset), int(array.shape[0]), array.dtype)


def _candidates(folder: str, impl: str) -> list[str]:
    suffix = ".npy" if impl == "npy" else ".bin"
    names = sorted(n for n in os.listdir(folder) if n.endswith(suffix))
    paths = [os.path.join(folder, n) for n in names]
    # A folder may hold Megatron .bin/.idx pairs too; those are not flat token files.
    return [p for p in paths if not os.path.isfile(p[:-4] + ".idx")]


def resolve_source(path: str, impl: str) -> dict[str, list[str]]:
    """The files of one data path: {'all': [...]} or, for a train/val folder,
    {'train': [...], 'valid': [...]}."""
    if os.path.isdir(path):
        files = _candidates(path, impl)
        train = [f for f in files if "train" in os.path.basename(f)]
        valid = [f for f in files if "val" in os.path.basename(f)]
        if not files:
            raise DataConfigError(f"{path}: folder holds no {impl} token files "
                                  f"({'.npy' if impl == 'npy' else '.bin'})")
        if train and valid:
            return {"train": train, "valid": valid}
        return {"all": files}
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path) if os.path.isfile(p))
        if not files:
            raise DataConfigError(f"{path}: the pattern matches no files (--data-impl {impl})")
        return {"all": files}
    return {"all": [path]}


def is_token_source(path: str) -> bool:
    """For ``--data-impl infer``: a .npy, a glob, a folder, or a .bin without an .idx."""
    if os.path.isfile(path + ".idx"):
        return False
    return (path.endswith((".npy", ".bin")) or glob.has_magic(path) or os.path.isdir(path))


def infer_token_impl(path: str) -> str:
    """'npy' or 'flat' from the file names of ``path``."""
    if path.endswith(".npy") or (not path.endswith(".bin") and os.path.isdir(path)
                                 and _candidates(path, "npy") and not _candidates(path, "flat")):
        return "npy"
    if glob.has_magic(path) and all(p.endswith(".npy") for p in glob.glob(path)):
        return "npy"
    return "flat"


class TokenSpans:
    """Token ranges of token files, read as an indexed dataset of pieces ("documents").

    ``spans`` are (file, first token, token count); each becomes pieces of at most
    ``PIECE_TOKENS``. Offers ``sizes``, ``doc_idx``, ``get``, ``dtype`` and ``len`` like
    ``MMapIndexedDataset``. Pickles by description (DataLoader workers re-open the files).
    """

    def __init__(self, spans: Sequence[tuple[TokenFile, int, int]],
                 in_memory: bool = False) -> None:
        self._spans, self._in_memory = list(spans), in_memory
        self._open()

    def _open(self) -> None:
        arrays = {}
        self._pieces: list[tuple[np.ndarray, int]] = []
        sizes = []
        for file, start, count in self._spans:
            if file.path not in arrays:
                arrays[file.path] = file.read(self._in_memory)
            for offset in range(start, start + count, PIECE_TOKENS):
                length = min(PIECE_TOKENS, start + count - offset)
                self._pieces.append((arrays[file.path], offset))
                sizes.append(length)
        self.sizes = np.asarray(sizes, dtype=np.int32)
        self.doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        dtypes = {file.dtype for file, _, _ in self._spans}
        self.dtype = np.dtype(np.int64) if len(dtypes) > 1 else next(iter(dtypes), FLAT_DTYPE)

    def __getstate__(self) -> dict:
        return {"_spans": self._spans, "_in_memory": self._in_memory}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of piece ``idx``."""
        array, start = self._pieces[int(idx)]
        size = int(self.sizes[int(idx)])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside piece {idx} "
                             f"({size} tokens)")
        return array[start + offset:start + offset + length]

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))


def _whole(files: Sequence[TokenFile]) -> list[tuple[TokenFile, int, int]]:
    return [(f, 0, f.count) for f in files if f.count]


def _cut(files: Sequence[TokenFile], begin: int, end: int) -> list[tuple[TokenFile, int, int]]:
    """The spans of tokens [begin, end) of the files' concatenated stream."""
    spans, base = [], 0
    for f in files:
        lo, hi = max(begin, base), min(end, base + f.count)
        if hi > lo:
            spans.append((f, lo - base, hi - lo))
        base += f.count
    return spans


def split_spans(path: str, impl: str, splits_string: str, log: bool = True
                ) -> list[list[tuple[TokenFile, int, int]]]:
    """[train, valid, test] spans of one data path (see the module docstring); ``log`` says
    how the path was split (the dataset builder does; the start-up checks, which read the
    same files first, do not, so the line is printed once)."""
    groups = resolve_source(path, impl)
    opened = {k: [open_token_file(p, impl) for p in v] for k, v in groups.items()}
    if "all" not in opened:
        if log:
            log_rank0(" > %s: train files %s, validation files %s (no test split)", path,
                      groups["train"], groups["valid"])
        return [_whole(opened["train"]), _whole(opened["valid"]), []]
    files = opened["all"]
    total = sum(f.count for f in files)
    bounds = get_train_valid_test_split_(splits_string, total)
    if log:
        log_rank0(" > %s: %d tokens in %d file(s); split %s by tokens at %s", path, total,
                  len(files), splits_string, bounds)
    return [_cut(files, bounds[s], bounds[s + 1]) for s in range(3)]


def whole_spans(path: str, impl: str) -> list[tuple[TokenFile, int, int]]:
    """Every token of a data path (for --train/valid/test-data-path)."""
    groups = resolve_source(path, impl)
    if "all" not in groups:
        raise DataConfigError(f"{path}: a folder of train and val files splits itself; give "
                              "it to --data-path, or name one file (or glob) per split flag")
    return _whole([open_token_file(p, impl) for p in groups["all"]])


def source_impl(path: str, data_impl: str) -> str:
    """The token-file impl of ``path`` under ``--data-impl`` (resolving 'infer')."""
    return infer_token_impl(path) if data_impl == "infer" else data_impl


def uses_token_files(paths: Sequence[str], data_impl: str) -> bool:
    """Whether ``--data-impl`` (or, for 'infer', every path) names flat/npy token files."""
    if data_impl in TOKEN_FILE_IMPLS:
        return True
    return data_impl == "infer" and bool(paths) and all(is_token_source(p) for p in paths)


__all__ = ["LLMC_MAGIC", "PIECE_TOKENS", "TOKEN_FILE_IMPLS", "TokenFile", "TokenSpans",
           "infer_token_impl", "is_token_source", "open_token_file", "resolve_source",
           "source_impl", "split_spans", "uses_token_files", "whole_spans"]

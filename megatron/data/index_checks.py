"""Structural checks of an mmap ``.idx``/``.bin`` pair, and Megatron-DeepSpeed's --append-eod index.

``index_problems`` lists what is wrong with an opened index and its ``.bin`` (the reader,
``indexed_dataset.MMapIndexedDataset``, refuses a pair with problems at open;
``tools/inspect_dataset.py --check`` prints them). One disagreement is not a problem: the index
Megatron-DeepSpeed's preprocess_data.py --append-eod writes (``find_uncounted_eod``), which is
read as Megatron-DeepSpeed reads it.

No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np


class IndexArrays(Protocol):
    """What the checks read of an opened index (an ``indexed_dataset.MMapIndex``)."""

    path: str
    code: int
    dtype: np.dtype
    sizes: np.ndarray
    pointers: np.ndarray
    doc_idx: np.ndarray

    def __len__(self) -> int: ...

# Index entries per vectorised step: bounded memory on indexes of billions of sequences.
_CHECK_CHUNK = 1 << 24
_ITEMSIZES = (1, 2, 4, 8)


def index_problems(index: IndexArrays, bin_path: str, bin_bytes: int) -> list[str]:
    """What is structurally wrong with an opened .idx and its .bin of ``bin_bytes`` bytes
    (empty when consistent); each problem names its file.

    Reads the index arrays (vectorised, in chunks): the pointers must advance by the sizes
    in the dtype's item size from byte 0, the document index must rise from 0 to at most the
    sequence count, and the .bin must end exactly where the last sequence does (a wrong dtype
    code or another dataset's .bin breaks one of these), or one token per non-empty document
    later, all of one id: Megatron-DeepSpeed's --append-eod index (``find_uncounted_eod``),
    whose tokens after the sampled documents are the only ones read here.
    """
    problems = layout_problems(index)
    if not problems:  # where the last sequence ends means something only with sound pointers
        problems += _bin_length_problems(index, bin_path, bin_bytes)
    return problems


def layout_problems(index: IndexArrays) -> list[str]:
    """The problems of the index arrays alone (pointers, sizes, document index)."""
    return _pointer_problems(index) + _doc_idx_problems(index)


def sequences_end(index: IndexArrays) -> int:
    """The byte of the .bin where the last sequence ends (what its length must be)."""
    if len(index) == 0:
        return 0
    return int(index.pointers[-1]) + int(index.sizes[-1]) * index.dtype.itemsize


def _chunks(n: int):
    for start in range(0, n, _CHECK_CHUNK):
        yield start, min(start + _CHECK_CHUNK, n)


def _pointer_problems(index: IndexArrays) -> list[str]:
    sizes, pointers, n = index.sizes, index.pointers, len(index)
    if n == 0:
        return []
    if int(pointers[0]) != 0:
        return [f"{index.path}: the first sequence starts at byte {int(pointers[0])} of the "
                ".bin, expected 0"]
    itemsize = index.dtype.itemsize
    for start, stop in _chunks(n):
        negative = np.flatnonzero(sizes[start:stop] < 0)
        if negative.size:
            i = start + int(negative[0])
            return [f"{index.path}: sequence {i} has a negative size {int(sizes[i])}"]
        last = min(stop, n - 1)  # steps from sequence i to i + 1 for i in [start, last)
        steps = np.diff(pointers[start:last + 1])
        bad = np.flatnonzero(steps != sizes[start:last].astype(np.int64) * itemsize)
        if bad.size:
            return [_pointer_problem(index, start + int(bad[0]) + 1)]
    return []


def _pointer_problem(index: IndexArrays, i: int) -> str:
    """Sequence ``i`` does not start where sequence ``i - 1`` ends."""
    itemsize = index.dtype.itemsize
    previous, step = int(index.sizes[i - 1]), int(index.pointers[i] - index.pointers[i - 1])
    text = (f"{index.path}: pointers do not advance by the sequence sizes: sequence {i} starts "
            f"{step} bytes after sequence {i - 1}, whose {previous} tokens of {index.dtype} take "
            f"{previous * itemsize}")
    if previous > 0 and step % previous == 0 and step // previous in _ITEMSIZES:
        text += (f"; the pointers fit {step // previous}-byte tokens: is the dtype code "
                 f"{index.code} ({index.dtype}) in the .idx wrong?")
    return text


def _doc_idx_problems(index: IndexArrays) -> list[str]:
    doc_idx, n = index.doc_idx, len(index)
    if len(doc_idx) == 0 or int(doc_idx[0]) != 0:
        first = int(doc_idx[0]) if len(doc_idx) else None
        return [f"{index.path}: the document index must start with 0, found {first} "
                f"({len(doc_idx)} entries)"]
    if int(doc_idx[-1]) > n:
        return [f"{index.path}: the document index ends at sequence {int(doc_idx[-1])} but "
                f"there are {n} sequences"]
    for start, stop in _chunks(len(doc_idx) - 1):
        falls = np.flatnonzero(np.diff(doc_idx[start:stop + 1]) < 0)
        if falls.size:
            j = start + int(falls[0]) + 1
            return [f"{index.path}: the document index decreases at entry {j} "
                    f"({int(doc_idx[j - 1])} then {int(doc_idx[j])})"]
    return []


def _bin_length_problems(index: IndexArrays, bin_path: str, bin_bytes: int) -> list[str]:
    itemsize, end = index.dtype.itemsize, sequences_end(index)
    if bin_bytes == end:
        return []
    text = (f"{bin_path}: file is {bin_bytes} bytes but {index.path} says its last sequence "
            f"ends at byte {end}")
    tokens = int(index.sizes.sum(dtype=np.int64))
    nonempty = _count_nonempty_documents(index.doc_idx)
    if bin_bytes - end == nonempty * itemsize > 0:
        return _uncounted_eod_problems(index, bin_path, text, nonempty)
    if tokens and bin_bytes % tokens == 0 and bin_bytes // tokens in _ITEMSIZES:
        return [text + f"; the .bin holds exactly {tokens} tokens of {bin_bytes // tokens} "
                f"bytes: is the dtype code {index.code} ({index.dtype}) in the .idx wrong?"]
    if bin_bytes < end:
        return [text + "; the .bin is truncated or belongs to another index"]
    return [text + "; the .bin is longer than the index describes: it belongs to another "
            "(larger) dataset, or the .idx leaves tokens out"]


# ----------------------------------------------------------------------------------------------
# Megatron-DeepSpeed's --append-eod index
# ----------------------------------------------------------------------------------------------
#
# Megatron-DeepSpeed's tools/preprocess_data.py --append-eod (fixed in Megatron-LM by its issue
# #431) writes each document's EOD to the .bin after the document's sentences, but the .idx
# sizes (and the pointers computed from them) leave it out. Its reader, and so its GPTDataset,
# use those pointers and sizes as they are: document k is read from k tokens before where it
# was written (starting with the previous document's EOD, for one-sentence documents) and the
# last tokens of the .bin are never read. We read such a pair the same way, so a run continues
# with Megatron-DeepSpeed's samples, and recognise it by its exact signature: sound pointers,
# and a .bin longer by one token per non-empty document, the same id after every document
# (checked on the first and last EOD_SAMPLE documents).

EOD_SAMPLE = 64


@dataclass(frozen=True)
class UncountedEod:
    """A Megatron-DeepSpeed --append-eod pair: ``documents`` non-empty documents, each
    followed in the .bin by the uncounted token ``eod``."""

    documents: int
    eod: int


def _count_nonempty_documents(doc_idx: np.ndarray) -> int:
    """Documents that hold at least one sequence (each got an EOD from --append-eod)."""
    count = 0
    for start, stop in _chunks(len(doc_idx) - 1):
        count += int(np.count_nonzero(np.diff(doc_idx[start:stop + 1])))
    return count


def _nonempty_documents(doc_idx: np.ndarray, first: bool, limit: int) -> list[int]:
    """Up to ``limit`` non-empty documents from the start (or the end) of the index."""
    found: list[int] = []
    chunks = list(_chunks(len(doc_idx) - 1))
    for start, stop in (chunks if first else reversed(chunks)):
        docs = start + np.flatnonzero(np.diff(doc_idx[start:stop + 1]))
        found += (docs[:limit - len(found)] if first else docs[::-1][:limit - len(found)]).tolist()
        if len(found) >= limit:
            break
    return sorted(found)


def _eods_after_documents(index: IndexArrays, bin_path: str) -> dict[int, int]:
    """{document: the token that follows it in the .bin} for the first and last EOD_SAMPLE
    non-empty documents, placing each where it was written: after k earlier EODs."""
    doc_idx, itemsize = index.doc_idx, index.dtype.itemsize
    total = _count_nonempty_documents(doc_idx)
    head = _nonempty_documents(doc_idx, True, EOD_SAMPLE)
    tail = _nonempty_documents(doc_idx, False, EOD_SAMPLE)
    earlier = {d: k for k, d in enumerate(head)}
    earlier.update({d: total - len(tail) + k for k, d in enumerate(tail)})
    docs = sorted(earlier)
    last = doc_idx[np.asarray(docs, dtype=np.int64) + 1] - 1  # each document's last sequence
    ends = index.pointers[last] // itemsize + index.sizes[last].astype(np.int64)
    positions = ends + np.asarray([earlier[d] for d in docs], dtype=np.int64)
    data = np.memmap(bin_path, dtype=index.dtype, mode="r")
    values = data[positions].tolist()
    del data
    return dict(zip(docs, (int(v) for v in values)))


def _uncounted_eod_problems(index: IndexArrays, bin_path: str, text: str,
                           nonempty: int) -> list[str]:
    """No problem when the one extra token per non-empty document is the same id after every
    sampled document: Megatron-DeepSpeed's --append-eod index, read as it reads it."""
    found = _eods_after_documents(index, bin_path)
    if len(set(found.values())) == 1:
        return []
    listed = ", ".join(f"{v} after document {d}" for d, v in list(found.items())[:4])
    return [text + f"; the .bin holds {nonempty} tokens more than the .idx counts, one per "
            "non-empty document as Megatron-DeepSpeed's preprocess_data.py --append-eod index "
            f"leaves, but they are not one EOD id ({listed}): the .bin belongs to another "
            "index"]


def find_uncounted_eod(index: IndexArrays, bin_path: str, bin_bytes: int
                       ) -> Optional[UncountedEod]:
    """The Megatron-DeepSpeed --append-eod quirk of an opened pair, or None for any other
    pair (a consistent one, or one with problems)."""
    if index_problems(index, bin_path, bin_bytes):
        return None
    return uncounted_eod_of_sound_pair(index, bin_path, bin_bytes)


def uncounted_eod_of_sound_pair(index: IndexArrays, bin_path: str, bin_bytes: int
                                 ) -> Optional[UncountedEod]:
    """For a pair without ``index_problems``: a .bin longer than the index can only be the
    quirk (``_bin_length_problems`` accepts nothing else)."""
    if bin_bytes == sequences_end(index):
        return None
    eod = next(iter(_eods_after_documents(index, bin_path).values()))
    return UncountedEod(_count_nonempty_documents(index.doc_idx), eod)


__all__ = ["EOD_SAMPLE", "UncountedEod", "find_uncounted_eod", "index_problems",
           "layout_problems", "sequences_end", "uncounted_eod_of_sound_pair"]

"""Rewriting the index of a Megatron-DeepSpeed ``--append-eod`` dataset so that it counts its EODs.

Megatron-DeepSpeed's ``tools/preprocess_data.py --append-eod`` writes each document's EOD to the
``.bin`` without counting it in the ``.idx`` sizes (see ``indexed_dataset.find_uncounted_eod``
for how such a pair is recognised and read meanwhile). ``fix_uncounted_eod_index`` adds the EOD
to the size of each non-empty document's last sequence and recomputes the pointers: the result
is byte for byte the index our ``tools/preprocess_data.py`` writes for the same input, and the
``.bin`` is not touched. ``tools/inspect_dataset.py --fix-eod-index PREFIX`` is its command.

No torch import.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndex,
    MMapIndexedDataset,
    UncountedEod,
    data_file_path,
    find_uncounted_eod,
    index_file_path,
    index_problems,
    write_index,
)

BACKUP_SUFFIX = ".megatron-deepspeed"


def counted_eod_sizes(index: MMapIndex) -> np.ndarray:
    """int64 [sequences]: the sizes with each non-empty document's EOD counted in its last
    sequence."""
    sizes = np.array(index.sizes, dtype=np.int64)
    doc_idx = np.asarray(index.doc_idx)
    ends = doc_idx[1:][np.diff(doc_idx) != 0]  # one past each non-empty document's last sequence
    sizes[ends - 1] += 1
    return sizes


def fix_uncounted_eod_index(prefix: str) -> tuple[UncountedEod, str]:
    """Rewrite ``prefix.idx`` of a Megatron-DeepSpeed --append-eod pair to count its EODs;
    returns the quirk found and the path the original index was kept at.

    Atomic: the original is first copied to ``<idx>.megatron-deepspeed`` (move it back to read
    the dataset as Megatron-DeepSpeed does again), then the new index is written under a
    temporary name and renamed over the .idx, so the .idx is always one complete version.
    Raises IndexedDatasetError, changing nothing, for any other pair.
    """
    idx, bin_path = index_file_path(prefix), data_file_path(prefix)
    dataset = MMapIndexedDataset(prefix, verify=False)
    try:
        index, bin_bytes = dataset.index, os.path.getsize(bin_path)
        quirk = find_uncounted_eod(index, bin_path, bin_bytes)
        if quirk is None:
            problems = index_problems(index, bin_path, bin_bytes)
            why = "; ".join(problems) if problems else "its sizes already count every token"
            raise IndexedDatasetError(f"{idx} is not a Megatron-DeepSpeed --append-eod index, "
                                      f"so nothing was changed: {why}")
        sizes = counted_eod_sizes(index)
        if int(sizes.max()) > np.iinfo(np.int32).max:
            raise IndexedDatasetError(f"{idx}: a sequence with its EOD is longer than 2^31-1 "
                                      "tokens; the int32 sizes cannot count it")
        dtype, doc_idx = index.dtype, np.array(index.doc_idx)
    finally:
        dataset.close()
    backup = idx + BACKUP_SUFFIX
    _copy_atomic(idx, backup)
    _write_atomic(idx, lambda tmp: write_index(tmp, dtype, sizes, doc_idx))
    return quirk, backup


def _copy_atomic(src: str, dst: str) -> None:
    _write_atomic(dst, lambda tmp: shutil.copyfile(src, tmp))


def _write_atomic(path: str, write) -> None:
    """``write(tmp)`` a file, then rename it to ``path``; the temporary goes on any failure."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


__all__ = ["BACKUP_SUFFIX", "counted_eod_sizes", "fix_uncounted_eod_index"]

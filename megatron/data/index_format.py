"""What both index formats share (the mmap one in ``indexed_dataset``, the legacy one in
``legacy_indexed_dataset``): the element dtype codes, the error their readers raise, the file
names of a prefix, and the items a builder accepts.

No torch import.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np

LEGACY_MAGIC = b"TNTIDX\x00\x00"  # the legacy 'lazy'/'cached' .idx starts with it

# Code -> dtype as written by Megatron-LM (megatron/core/datasets) and Megatron-DeepSpeed.
# Both agree on 1-6 and 8.  Code 7 is float32 in Megatron-LM but float64 in older
# Megatron-DeepSpeed; the reader settles it from the pointer spacing (indexed_dataset._resolve_code_7).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
            np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.float64): 6,
            np.dtype(np.float32): 7, np.dtype(np.uint16): 8}

DTypeLike = Union[np.dtype, type, str]


class IndexedDatasetError(ValueError):
    """An .idx/.bin pair is missing, corrupt or inconsistent; the message names the file."""


def dtype_code(dtype: DTypeLike) -> int:
    """The .idx code of a numpy dtype (raises for dtypes the format cannot store)."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"dtype {dt} cannot be stored in an .idx file; use one of "
                         f"{sorted(str(d) for d in _CODE_OF)}")
    return _CODE_OF[dt]


def data_file_path(prefix_path: str) -> str:
    return prefix_path + ".bin"


def index_file_path(prefix_path: str) -> str:
    return prefix_path + ".idx"


def as_numpy(item: Any) -> np.ndarray:
    """A 1-D numpy view of a numpy array, a list of ints or a (CPU or GPU) torch tensor."""
    if isinstance(item, np.ndarray):
        return item.reshape(-1)
    if hasattr(item, "detach") and hasattr(item, "cpu"):  # torch.Tensor, without importing torch
        return item.detach().cpu().numpy().reshape(-1)
    return np.asarray(item).reshape(-1)

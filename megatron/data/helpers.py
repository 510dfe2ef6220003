"""Index builders for the GPT and blended datasets: C++ when built, numpy otherwise.

Both paths give identical arrays (tests/unit/data/test_helpers.py checks it), so a machine
without a compiler still reproduces Megatron's sample order.  No torch import here.

``build_sample_idx`` semantics: lay the documents of ``doc_idx`` end to end (``sizes[doc_idx[j]]``
tokens each).  Sample k reads ``seq_length + add_extra_token`` tokens starting at global
position ``k * seq_length``, so consecutive samples share ``add_extra_token`` tokens (the label
of the last input).  Row k of the result is (j, offset) of sample k's first token, with j an
index into ``doc_idx``; row k + 1 marks where sample k ends (``GPTDataset`` reads up to
``offset + add_extra_token`` of that row).  With ``drop_last_partial_sequence`` the tokens after
the last full sample are the documented remainder:
``total - add_extra_token - num_samples * seq_length`` tokens, fewer than ``seq_length``.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

try:
    from megatron.data import helpers_cpp as _cpp
except ImportError:  # no compiler at install time: the numpy path gives the same arrays
    _cpp = None

logger = logging.getLogger(__name__)

_INT32_MAX = np.iinfo(np.int32).max


def cpp_available() -> bool:
    """Whether the compiled ``megatron.data.helpers_cpp`` extension is importable."""
    return _cpp is not None


def num_samples_in(total_tokens: int, seq_length: int, add_extra_token: int = 1,
                   drop_last_partial_sequence: bool = True) -> int:
    """How many samples ``total_tokens`` laid end to end yield (Megatron's count)."""
    usable = int(total_tokens) - add_extra_token
    if usable <= 0:
        return 0
    if drop_last_partial_sequence:
        return usable // seq_length
    return -(-usable // seq_length)


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                     add_extra_token: int = 1, dtype: Optional[np.dtype] = None,
                     use_cpp: Optional[bool] = None) -> np.ndarray:
    """[num_samples + 1, 2] array of (index into doc_idx, token offset) where samples start.

    ``dtype`` is int32 (Megatron's) by default and int64 when int32 cannot hold the values.
    ``use_cpp`` forces a path (None: C++ when available).
    """
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx)
    if doc_idx.dtype not in (np.int32, np.int64):
        doc_idx = doc_idx.astype(np.int64)
    if dtype is None:
        too_big = len(doc_idx) > _INT32_MAX or (len(sizes) and int(sizes.max()) > _INT32_MAX)
        dtype = np.int64 if too_big else np.int32
    dtype = np.dtype(dtype)
    if dtype not in (np.int32, np.int64):
        raise ValueError(f"build_sample_idx: dtype must be int32 or int64, got {dtype}")
    args = (sizes, doc_idx, int(seq_length), int(num_epochs), int(tokens_per_epoch),
            bool(drop_last_partial_sequence), int(add_extra_token))
    if use_cpp is None:
        use_cpp = _cpp is not None
    if use_cpp:
        if _cpp is None:
            raise RuntimeError("megatron.data.helpers_cpp is not built; run `pip install -e .`")
        fn = _cpp.build_sample_idx if dtype == np.int32 else _cpp.build_sample_idx_int64
        return fn(*args)
    return _build_sample_idx_numpy(*args).astype(dtype)


def _build_sample_idx_numpy(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                            num_epochs: int, tokens_per_epoch: int, drop_last: bool,
                            extra: int) -> np.ndarray:
    """Vectorised equivalent of the C++ walk (see the module docstring)."""
    if seq_length < 1:
        raise ValueError("build_sample_idx: seq_length must be >= 1")
    if len(doc_idx) and (int(doc_idx.min()) < 0 or int(doc_idx.max()) >= len(sizes)):
        raise IndexError(f"build_sample_idx: doc_idx values outside sizes of length {len(sizes)}")
    num_samples = num_samples_in(num_epochs * tokens_per_epoch, seq_length, extra, drop_last)
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    if num_samples == 0:
        return out
    lengths = sizes[doc_idx].astype(np.int64)  # [m] tokens of each doc_idx row
    ends = np.cumsum(lengths)  # [m] exclusive end position of each row
    starts = ends - lengths
    # The sample ending at inclusive position e hands its last `extra` tokens to the next one,
    # whose start is recorded in the row of the document holding e (empty documents hold none).
    last_token = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length + extra - 1
    row = np.searchsorted(ends, last_token, side="right")
    past_end = row >= len(lengths)
    if past_end.any():
        # Only the kept partial last sample may run past the data (as in the C++ walk).
        if not past_end[-1] or past_end[:-1].any() or drop_last:
            raise RuntimeError("build_sample_idx: tokens_per_epoch is larger than the documents "
                               "in doc_idx hold")
        row[-1] = len(lengths) - 1
        last_token[-1] = ends[-1] - 1
    out[1:, 0] = row
    out[1:, 1] = last_token - starts[row] + 1 - extra
    return out


def build_blending_indices(dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                           weights: np.ndarray, num_datasets: int, size: int,
                           verbose: bool = False, use_cpp: Optional[bool] = None) -> None:
    """Fill ``dataset_index`` (uint8 or int16 [size]) and ``dataset_sample_index`` (int64
    [size]) in place with Megatron's greedy blend of ``weights`` (normalised float64)."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if use_cpp is None:
        use_cpp = _cpp is not None
    if use_cpp:
        if _cpp is None:
            raise RuntimeError("megatron.data.helpers_cpp is not built; run `pip install -e .`")
        _cpp.build_blending_indices(dataset_index, dataset_sample_index, weights,
                                    int(num_datasets), int(size), bool(verbose))
        return
    _build_blending_indices_python(dataset_index, dataset_sample_index, weights,
                                   int(num_datasets), int(size))
    if verbose:
        counts = np.bincount(dataset_index[:size], minlength=num_datasets)
        for d in range(num_datasets):
            logger.info("   dataset %d, weight: %g, achieved: %g", d, weights[d],
                        counts[d] / max(size, 1))


def _build_blending_indices_python(dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                                   weights: np.ndarray, num_datasets: int, size: int) -> None:
    # Python floats are IEEE doubles, so this rounds exactly like the C++ loop.
    w = [float(x) for x in weights[:num_datasets]]
    taken = [0] * num_datasets
    chosen = np.empty(size, dtype=np.int64)
    picked_sample = np.empty(size, dtype=np.int64)
    for i in range(size):
        position = max(float(i), 1.0)
        best, best_error = 0, w[0] * position - float(taken[0])
        for d in range(1, num_datasets):
            error = w[d] * position - float(taken[d])
            if error > best_error:
                best, best_error = d, error
        chosen[i] = best
        picked_sample[i] = taken[best]
        taken[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = picked_sample

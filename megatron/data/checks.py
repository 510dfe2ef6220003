"""The training data checked before any process group or model exists.

``check_training_data`` opens every dataset the data flags name (the reader then runs its
structural checks, ``indexed_dataset.index_problems``), requires documents in each and in the
training split, and compares the token ids of each ``.bin`` with the tokenizer's vocabulary.

The id range needs one full scan of the ``.bin``; it is cached as ``<md5>_token_range.json``
in the index-cache folder (``IndexCache``: ``--data-cache-path`` or beside the data), keyed by
the sizes and modification times of the ``.bin`` and ``.idx``, so each dataset is scanned once
and every later run reads a small JSON file.

Errors are ``DataConfigError`` or ``IndexedDatasetError``; each names the flag or the file.
No torch import.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np

from megatron.data import token_files
from megatron.data.dataset_utils import (
    DEFAULT_SPLIT,
    DataConfigError,
    FileLock,
    IndexCache,
    description_hash,
    get_train_valid_test_split_,
    json_text,
    log_rank0,
    parse_data_path,
    parse_split,
    write_cache_set,
)
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
    make_dataset,
)

SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
SCAN_CHUNK_BYTES = 64 << 20  # bounded memory whatever the .bin size
TOKEN_RANGE_VERSION = 1


@dataclass(frozen=True)
class TokenRange:
    """The smallest and largest token id of a ``.bin``, and how many tokens it holds."""

    min_id: int
    max_id: int
    tokens: int


# Token id range ---------------------------------------------------------------------------


def scan_token_range(dataset: MMapIndexedDataset,
                     chunk_bytes: int = SCAN_CHUNK_BYTES) -> TokenRange:
    """Read every token of ``dataset`` once (in chunks of the memory map) for its id range."""
    bin_path = data_file_path(dataset.path_prefix)
    dtype = dataset.dtype
    tokens = os.path.getsize(bin_path) // dtype.itemsize
    if tokens == 0:
        return TokenRange(0, -1, 0)
    data = np.memmap(bin_path, dtype=dtype, mode="r", shape=(tokens,))
    step = max(1, chunk_bytes // dtype.itemsize)
    low, high = None, None
    for start in range(0, tokens, step):
        chunk = data[start:start + step]
        chunk_low, chunk_high = chunk.min(), chunk.max()
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
    del data
    return TokenRange(int(low), int(high), tokens)


def _file_stamp(prefix: str) -> dict[str, int]:
    """What identifies one version of the pair: sizes and modification times."""
    stamp = {}
    for kind, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        st = os.stat(path)
        stamp[f"{kind}_bytes"], stamp[f"{kind}_mtime_ns"] = st.st_size, st.st_mtime_ns
    return stamp


def _read_cached_range(path: str, expected: dict[str, Any]) -> Optional[TokenRange]:
    """The cached range when ``path`` holds one for exactly this version of the data."""
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
        if any(cached.get(k) != v for k, v in expected.items()):
            return None
        return TokenRange(int(cached["min_id"]), int(cached["max_id"]), int(cached["tokens"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable or from another version: scan again


def cached_token_range(dataset: MMapIndexedDataset, data_cache_path: Optional[str] = None,
                       lock_timeout_s: float = 7200.0) -> TokenRange:
    """``scan_token_range`` of ``dataset``, scanned once per version of its files."""
    prefix = dataset.path_prefix
    expected = {"version": TOKEN_RANGE_VERSION, "data_prefix": os.path.abspath(prefix),
                **_file_stamp(prefix)}
    name = description_hash(f"Token range\nData prefix {expected['data_prefix']}\n")
    name += "_token_range.json"
    cache = IndexCache(prefix, data_cache_path, lock_timeout_s=lock_timeout_s)
    for folder in cache.candidates([name]):
        hit = _read_cached_range(os.path.join(folder, name), expected)
        if hit is not None:
            return hit
    folder = cache.build_dir()
    path = os.path.join(folder, name)
    with FileLock(path + ".lock", lock_timeout_s):
        hit = _read_cached_range(path, expected)  # another process scanned while we waited
        if hit is not None:
            return hit
        start = time.time()
        found = scan_token_range(dataset)
        seconds = time.time() - start
        write_cache_set(folder, {}, {name: json_text({**expected, **asdict(found),
                                                      "scan_seconds": round(seconds, 3)})})
    log_rank0(" > scanned %s once for its token ids (%d tokens, ids %d..%d) in %.2f s; cached "
              "in %s", data_file_path(prefix), found.tokens, found.min_id, found.max_id,
              seconds, path)
    return found


def check_token_ids(dataset: MMapIndexedDataset, vocab_size: int, tokenizer_flags: str,
                    data_cache_path: Optional[str] = None) -> None:
    """Raise DataConfigError naming the .bin when an id falls outside [0, vocab_size)."""
    found = cached_token_range(dataset, data_cache_path)
    bin_path = data_file_path(dataset.path_prefix)
    if found.tokens and found.max_id >= vocab_size:
        raise DataConfigError(
            f"{bin_path}: its largest token id is {found.max_id}, but the tokenizer "
            f"({tokenizer_flags}) has a vocabulary of {vocab_size} ids (0..{vocab_size - 1}); "
            "was the dataset preprocessed with another tokenizer?")
    if found.tokens and found.min_id < 0:
        raise DataConfigError(
            f"{bin_path}: holds the negative token id {found.min_id} as {dataset.dtype}; is the "
            f"dtype code in {index_file_path(dataset.path_prefix)} wrong (uint16 data read as "
            "int16?)")


def tokenizer_flags(data: Any) -> str:
    """The flags that chose the tokenizer, as the user wrote them (for error messages)."""
    kind = getattr(data, "tokenizer_type", None)
    if kind == "NullTokenizer":
        return f"--tokenizer-type NullTokenizer --vocab-size {getattr(data, 'vocab_size', None)}"
    if kind == "PretrainedFromHF":
        return f"--tokenizer-name-or-path {getattr(data, 'tokenizer_name_or_path', None)}"
    return f"--tokenizer-type {kind} --vocab-file {getattr(data, 'vocab_file', None)}"


# Sources, documents and the training split ------------------------------------------------


def data_sources(data: Any) -> list[tuple[str, list[str]]]:
    """(flag, prefixes) of ``--data-path`` or of each per-split path that is given."""
    values = [("--data-path", getattr(data, "data_path", None))]
    values += [(flag, getattr(data, flag[2:].replace("-", "_"), None)) for flag in SPLIT_FLAGS]
    sources = []
    for flag, value in values:
        parsed = parse_data_path(list(value) if value else None, flag)
        if parsed is not None:
            sources.append((flag, parsed[0]))
    return sources


def open_checked(flag: str, prefix: str, data_impl: str = "mmap") -> MMapIndexedDataset:
    """The dataset at ``prefix``, which must exist, be consistent and hold documents."""
    missing = [p for p in (index_file_path(prefix), data_file_path(prefix))
               if not os.path.isfile(p)]
    if missing:
        hint = (" (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx"))
                else "")
        raise DataConfigError(f"{flag}: dataset {prefix!r} has no {' and no '.join(missing)}"
                              f"{hint}")
    try:
        dataset = make_dataset(prefix, data_impl)
    except IndexedDatasetError as e:
        raise IndexedDatasetError(f"{flag}: {e}") from None
    if len(dataset) == 0:
        raise DataConfigError(f"{flag}: {index_file_path(prefix)} holds no documents (was its "
                              "input empty?)")
    return dataset


SPLIT_REMEDY = "give the training share more weight"


def sample_tokens_problem(lead: str, tokens: int, seq_length: int, train_samples: int,
                          remedy: str = SPLIT_REMEDY) -> Optional[str]:
    """Why ``tokens`` training tokens (``lead`` says where, and how many) cannot serve
    training, or None: one sample takes --seq-length + 1 tokens, and fewer would repeat the
    same documents within each sample, epoch after epoch."""
    need = seq_length + 1
    if tokens >= need:
        return None
    return (f"{lead}, fewer than one training sample needs ({need} at "
            f"--seq-length {seq_length}), but {train_samples} training samples are asked for "
            f"(--train-iters/--train-samples); {remedy}")


def check_train_split(prefix: str, dataset: MMapIndexedDataset, split: str,
                      train_samples: int, seq_length: int = 1) -> None:
    """The training share of ``--split`` must have a weight and hold one sample of ``prefix``:
    refused the same way whatever the dataset's size (Megatron's rounding can hand a share
    of weight 0 a document of a large dataset, and none of a small one)."""
    n = len(dataset)
    start, end = get_train_valid_test_split_(split, n)[:2]
    if parse_split(split)[0] == 0:
        raise DataConfigError(
            f"--split {split} gives training no weight (Megatron's rounding leaves it "
            f"{end - start} of the {n} documents of {prefix}), but {train_samples} training "
            "samples are asked for (--train-iters/--train-samples); give the training share a "
            "weight")
    tokens = int(dataset.sizes[start:end].sum(dtype=np.int64))
    lead = (f"--split {split} leaves {end - start} of the {n} documents of {prefix} ({tokens} "
            "tokens) for training")
    problem = sample_tokens_problem(lead, tokens, seq_length, train_samples)
    if problem is not None:
        raise DataConfigError(problem)


def check_training_data(data: Any, vocab_size: Optional[int], train_samples: int,
                        seq_length: int = 1, eval_samples: tuple[int, int] = (0, 0)) -> None:
    """Everything about the data flags that can be known before training: files, structure,
    documents, the training split (one sample of ``seq_length`` + 1 tokens at least), a
    blend's validation and test shares, and the token ids (``vocab_size`` None skips them).

    ``data`` is the run's data config (``DataConfig``); ``train_samples`` and
    ``eval_samples`` (validation, test) what the run asks of each split.
    """
    if getattr(data, "mock_data", False):
        return
    sources = data_sources(data)
    flags = [flag for flag, _ in sources]
    if train_samples > 0 and "--data-path" not in flags and "--train-data-path" not in flags:
        raise DataConfigError(f"no training data: {train_samples} training samples are asked "
                              "for; give --data-path or --train-data-path")
    opened = []
    for flag, prefixes in sources:  # every cheap check of every dataset before any scan
        if check_token_files(flag, prefixes, data, train_samples, seq_length):
            continue
        datasets = [_open_source(flag, p, data, train_samples, seq_length) for p in prefixes]
        if flag == "--data-path" and len(prefixes) > 1:
            check_blend_eval_shares(prefixes, datasets, getattr(data, "split", DEFAULT_SPLIT),
                                    eval_samples)
        opened += datasets
    for dataset in opened:
        if vocab_size is not None:
            check_token_ids(dataset, vocab_size, tokenizer_flags(data),
                            getattr(data, "data_cache_path", None))
        if hasattr(dataset, "close"):
            dataset.close()


def _open_source(flag: str, prefix: str, data: Any, train_samples: int,
                 seq_length: int) -> MMapIndexedDataset:
    """One dataset of ``flag``, opened and checked, with what training needs of it."""
    dataset = open_checked(flag, prefix, getattr(data, "data_impl", "mmap"))
    if flag == "--data-path" and train_samples > 0:
        check_train_split(prefix, dataset, getattr(data, "split", DEFAULT_SPLIT),
                          train_samples, seq_length)
    elif flag == "--train-data-path" and train_samples > 0:
        tokens = int(dataset.sizes.sum(dtype=np.int64))
        problem = sample_tokens_problem(f"--train-data-path: {prefix} holds {tokens} tokens",
                                        tokens, seq_length, train_samples, "give it more data")
        if problem is not None:
            raise DataConfigError(problem)
    return dataset


def check_blend_eval_shares(prefixes: list[str], datasets: list, split: str,
                            eval_samples: tuple[int, int]) -> None:
    """A blend draws validation (and test) samples from each dataset by its weight: every
    dataset must hold documents in that share of ``--split``, or none (no such dataset)."""
    for s, name, samples in ((1, "validation", eval_samples[0]), (2, "test", eval_samples[1])):
        if samples <= 0:
            continue
        counts = []
        for dataset in datasets:
            bounds = get_train_valid_test_split_(split, len(dataset))
            counts.append(bounds[s + 1] - bounds[s])
        if 0 in counts and any(counts):
            empty = counts.index(0)
            raise DataConfigError(
                f"--split {split} leaves no {name} documents of {prefixes[empty]} "
                f"({len(datasets[empty])} documents in all), but the blend --data-path draws "
                f"{samples} {name} samples from each of its datasets by weight (--eval-iters); "
                f"give the {name} share more weight, or evaluate with --eval-iters 0")


def check_token_files(flag: str, paths: list[str], data: Any, train_samples: int,
                      seq_length: int = 1) -> bool:
    """For flat/npy token files (``token_files``): every file opens (headers, sizes) and
    the training split holds one sample; returns False when ``paths`` are not token files.
    Their id range is not scanned (the files carry no dtype to check it against cheaply)."""
    data_impl = getattr(data, "data_impl", "mmap")
    if not token_files.uses_token_files(paths, data_impl):
        return False
    split = getattr(data, "split", DEFAULT_SPLIT)
    for path in paths:
        impl = token_files.source_impl(path, data_impl)
        try:
            if flag != "--data-path":
                spans = token_files.whole_spans(path, impl)
            else:
                spans = token_files.split_spans(path, impl, split, log=False)[0]
        except DataConfigError as e:
            raise DataConfigError(f"{flag}: {e}") from None
        tokens = sum(count for _, _, count in spans)
        lead = (f"{flag}: the training tokens of {path} (--data-impl {impl}, --split {split}) "
                f"number {tokens}")
        remedy = SPLIT_REMEDY if flag == "--data-path" else "give it more data"
        problem = sample_tokens_problem(lead, tokens, seq_length, train_samples, remedy)
        if flag in ("--data-path", "--train-data-path") and train_samples > 0 and problem:
            raise DataConfigError(problem)
    return True


__all__ = [
    "TokenRange", "cached_token_range", "check_blend_eval_shares", "check_token_ids",
    "check_train_split", "check_training_data", "data_sources", "open_checked",
    "sample_tokens_problem", "scan_token_range", "tokenizer_flags",
]

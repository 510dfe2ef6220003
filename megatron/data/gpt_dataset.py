"""GPT pre-training samples: fixed windows of ``seq_length + 1`` tokens over shuffled documents.

Three index arrays decide which tokens sample i holds, built exactly as Megatron-DeepSpeed's
``_build_index_mappings`` does for the same seed, so switching frameworks keeps the order:

- ``doc_idx`` (int32 [epochs * documents]): the documents of every epoch, shuffled with
  ``numpy.random.RandomState(seed)``.  When more than one epoch is needed and the last epoch
  uses under 80% of its samples, that epoch is shuffled separately (appended after the others).
- ``sample_idx`` (int32 [samples + 1, 2]): (row of doc_idx, token offset) where each sample
  starts; consecutive samples share one token (the label of the last input).
- ``shuffle_idx`` (uint32 [samples]): the order samples are served in; with a separate last
  epoch its samples are shuffled among themselves, after all the others.

The arrays are cached as ``<md5>_{doc,sample,shuffle}_idx.npy`` plus ``<md5>.dsc`` (the
description hashed, Megatron-DeepSpeed's names, so each framework reuses the other's cache)
and ``<md5>.json``; see ``dataset_utils.IndexCache`` for where and how.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

from megatron.data import helpers, token_files
from megatron.data.blended_dataset import BlendedDataset, build_blending_index_cached
from megatron.data.dataset_utils import (
    DataConfigError,
    DataPath,
    IndexCache,
    description_hash,
    get_train_valid_test_split_,
    json_text,
    log_rank0,
    normalize_weights,
    parse_data_path,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, make_dataset
from megatron.data.token_files import uses_token_files

logger = logging.getLogger(__name__)

SEPARATE_LAST_EPOCH_THRESHOLD = 0.80
SPLIT_NAMES = ("train", "valid", "test")


# ----------------------------------------------------------------------------------------------
# Index arrays (pure functions of documents, sizes, sample count, sequence length and seed)
# ----------------------------------------------------------------------------------------------


def num_tokens(documents: np.ndarray, sizes: np.ndarray) -> int:
    """Tokens in one epoch: the summed sizes of ``documents``."""
    return int(np.sum(sizes[documents], dtype=np.int64))


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs E (>= 1) with (E * tokens_per_epoch - 1) // seq_length >= num_samples."""
    if tokens_per_epoch < 2:
        raise ValueError(f"an epoch of {tokens_per_epoch} tokens cannot make a sample")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def use_separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int,
                            num_samples: int) -> tuple[bool, int]:
    """(whether the last epoch is shuffled on its own, samples served before that epoch)."""
    if num_epochs == 1:
        return False, 0
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    in_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
    separate = in_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch)
    log_rank0(" > last epoch uses %d of %d samples per epoch: separate_last_epoch=%s",
              in_last, per_epoch, separate)
    return separate, before_last


def build_doc_idx(documents: np.ndarray, num_epochs: int, np_rng: np.random.RandomState,
                  separate_last_epoch: bool) -> np.ndarray:
    """int32 [num_epochs * len(documents)]: every document once per epoch, shuffled."""
    if separate_last_epoch and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, np_rng, False)
        last = build_doc_idx(documents, 1, np_rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
    np_rng.shuffle(doc_idx)
    return doc_idx


def build_shuffle_idx(num_samples: int, total_size: int,
                      np_rng: np.random.RandomState) -> np.ndarray:
    """Shuffled [0, num_samples) followed by shuffled [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


def build_index_arrays(documents: np.ndarray, sizes: np.ndarray, num_samples: int,
                       seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx for ``num_samples`` samples (no caching)."""
    tokens_per_epoch = num_tokens(documents, sizes)
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate, before_last = use_separate_last_epoch(epochs, tokens_per_epoch, seq_length,
                                                    num_samples)
    np_rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, epochs, np_rng, separate)
    sample_idx = helpers.build_sample_idx(np.asarray(sizes, dtype=np.int32), doc_idx, seq_length,
                                          epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffle_idx = build_shuffle_idx(before_last if separate else total, total, np_rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def index_description(name: str, data_prefix: str, num_samples: int, num_epochs: int,
                      seq_length: int, seed: int, splits_string: str) -> str:
    """The text Megatron-DeepSpeed hashes (md5) to name the cache files."""
    return (f"GPT Dataset\n\nData prefix {data_prefix}\nDataset name {name}\n"
            f"Number of samples {num_samples}\nNumber of epochs {num_epochs}\n"
            f"Sequence length {seq_length}\nRandom seed {seed}\nSplit {splits_string}\n")


def _sample_end_problem(sample_idx: np.ndarray, doc_idx: np.ndarray, sizes: np.ndarray,
                        total_tokens: int, end_token: int) -> Optional[str]:
    """Why a cached sample_idx does not fit ``sizes`` (None when it does): its last entry,
    (row of doc_idx, offset), must sit at token ``end_token`` of the epochs' token stream.

    The cache is named from the flags alone (Megatron-DeepSpeed's names), so a dataset
    rewritten in place, for instance by ``tools/inspect_dataset.py --fix-eod-index``, would
    otherwise reuse a sample index of its old sizes. Reads only the few documents after the
    entry: every document is in doc_idx once per epoch, so the tokens before it are the total
    less those.
    """
    row, offset = (int(v) for v in sample_idx[-1])
    after = int(np.sum(sizes[np.asarray(doc_idx[row:])], dtype=np.int64))
    at = total_tokens - after + offset
    if at != end_token:
        return (f"sample_idx ends at token {at} of the epochs' {total_tokens}, but the "
                f"dataset's sizes put its last sample at {end_token} (the dataset changed "
                "since the cache was built)")
    return None


def build_index_mappings(name: str, data_prefix: str, documents: np.ndarray, sizes: np.ndarray,
                         splits_string: str, num_samples: int, seq_length: int, seed: int, *,
                         data_cache_path: Optional[str] = None,
                         lock_timeout_s: float = 7200.0) -> tuple[dict[str, np.ndarray], str]:
    """Load (or build and cache) the index arrays; returns ({name: mmap array}, description)."""
    if num_samples < 0:
        raise DataConfigError(f"{data_prefix} ({name}): number of samples {num_samples} < 0")
    tokens_per_epoch = num_tokens(documents, sizes)
    if tokens_per_epoch < 2:
        raise DataConfigError(
            f"{data_prefix}: the {name} split (documents [{documents[0]}, {documents[-1] + 1})) "
            f"holds {tokens_per_epoch} tokens; a sample needs at least 2")
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    desc = index_description(name, data_prefix, num_samples, epochs, seq_length, seed,
                             splits_string)
    key = description_hash(desc)
    files = {k: f"{key}_{k}.npy" for k in ("doc_idx", "sample_idx", "shuffle_idx")}
    expected_samples = helpers.num_samples_in(epochs * tokens_per_epoch, seq_length)

    def validate(arrays: dict[str, np.ndarray]) -> Optional[str]:
        doc_idx = arrays[files["doc_idx"]]
        sample_idx = arrays[files["sample_idx"]]
        shuffle_idx = arrays[files["shuffle_idx"]]
        if doc_idx.shape != (epochs * len(documents),):
            return f"doc_idx has {doc_idx.shape[0]} entries, expected {epochs * len(documents)}"
        if sample_idx.shape != (expected_samples + 1, 2):
            return f"sample_idx has shape {sample_idx.shape}, expected ({expected_samples + 1}, 2)"
        if shuffle_idx.shape != (expected_samples,):
            return f"shuffle_idx has {shuffle_idx.shape[0]} entries, expected {expected_samples}"
        return _sample_end_problem(sample_idx, doc_idx, sizes, epochs * tokens_per_epoch,
                                   expected_samples * seq_length)

    def build() -> dict[str, np.ndarray]:
        log_rank0(" > building GPT index mappings for %s (%s): %d samples, %d epochs",
                  data_prefix, name, num_samples, epochs)
        arrays = build_index_arrays(documents, sizes, num_samples, seq_length, seed)
        return {files[k]: v for k, v in arrays.items()}

    info = {"data_prefix": data_prefix, "name": name, "num_samples": num_samples,
            "num_epochs": epochs, "seq_length": seq_length, "seed": seed,
            "split": splits_string, "documents": [int(documents[0]), int(documents[-1]) + 1],
            "tokens_per_epoch": tokens_per_epoch, "samples_in_index": expected_samples,
            "sample_idx_builder": "cpp" if helpers.cpp_available() else "numpy"}
    cache = IndexCache(data_prefix, data_cache_path, lock_timeout_s=lock_timeout_s)
    loaded = cache.load_or_build(key, list(files.values()), build, validate,
                                 extra_files={f"{key}.dsc": desc},
                                 optional_files={f"{key}.json": json_text(info)})
    return {k: loaded[f] for k, f in files.items()}, desc


# ----------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------


class GPTDataset:
    """Map-style dataset: ``ds[i]`` is ``{'text': int64 [seq_length + 1]}``.

    ``len(ds)`` counts every sample of every epoch built (at least ``num_samples``).
    Pickles without its index arrays (workers re-open the cached .npy files).
    """

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray,
                 indexed_dataset: MMapIndexedDataset, splits_string: str, num_samples: int,
                 seq_length: int, seed: int, *, data_cache_path: Optional[str] = None,
                 lock_timeout_s: float = 7200.0) -> None:
        documents = np.asarray(documents)
        n = len(indexed_dataset.sizes)
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= n:
            raise DataConfigError(f"{data_prefix} ({name}): document range outside [0, {n})")
        self.name, self.data_prefix = name, data_prefix
        self.indexed_dataset = indexed_dataset
        self.seq_length, self.num_samples = seq_length, num_samples
        self._build_args = (name, data_prefix, documents, splits_string, num_samples, seq_length,
                            seed, data_cache_path, lock_timeout_s)
        self._load_indices()

    def _load_indices(self) -> None:
        name, prefix, documents, splits, num_samples, seq_length, seed, cache, timeout = \
            self._build_args
        arrays, self.desc = build_index_mappings(
            name, prefix, documents, self.indexed_dataset.sizes, splits, num_samples, seq_length,
            seed, data_cache_path=cache, lock_timeout_s=timeout)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        self.desc_hash = description_hash(self.desc)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for k in ("doc_idx", "sample_idx", "shuffle_idx"):
            state[k] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load_indices()

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        n = len(self)
        i = int(idx)
        if not -n <= i < n:
            raise IndexError(f"sample {idx} out of range for {self.name} dataset of {n} samples")
        j = int(self.shuffle_idx[i])
        (row_f, off_f), (row_l, off_l) = self.sample_idx[j], self.sample_idx[j + 1]
        row_f, off_f, row_l, off_l = int(row_f), int(off_f), int(row_l), int(off_l)
        get, doc_idx = self.indexed_dataset.get, self.doc_idx
        if row_f == row_l:
            parts = [get(doc_idx[row_f], offset=off_f, length=off_l - off_f + 1)]
        else:
            parts = [get(doc_idx[row_f], offset=off_f)]
            parts += [get(doc_idx[r]) for r in range(row_f + 1, row_l)]
            parts.append(get(doc_idx[row_l], length=off_l + 1))
        return {"text": np.concatenate(parts).astype(np.int64)}


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def _open(prefix: str, data_impl: str, skip_warmup: bool,
          in_memory: bool = False) -> MMapIndexedDataset:
    """The dataset at ``prefix``: a .bin/.idx pair (mmap, lazy, cached) or, for flat/npy,
    every token of the token files it names (``token_files.TokenSpans``)."""
    if token_files.uses_token_files([prefix], data_impl):
        impl = token_files.source_impl(prefix, data_impl)
        ds = token_files.TokenSpans(token_files.whole_spans(prefix, impl), in_memory)
        log_rank0(" > %s (%s): %d tokens", prefix, impl, ds.num_tokens)
        return ds
    ds = make_dataset(prefix, data_impl, skip_warmup, in_memory)
    log_rank0(" > %s: %d sequences, %d documents", prefix, len(ds), len(ds.doc_idx) - 1)
    return ds


def _token_file_builder(prefixes: list[str], weights: Optional[list[float]], data_impl: str,
                        splits_string: str, num_samples: Sequence[int], seq_length: int,
                        seed: int, in_memory: bool, common: dict) -> Callable[[int], object]:
    """The builder of split s of flat/npy token files, split by tokens (see ``token_files``)."""
    per_prefix = []
    for prefix in prefixes:
        impl = token_files.source_impl(prefix, data_impl)
        spans = token_files.split_spans(prefix, impl, splits_string)
        per_prefix.append([token_files.TokenSpans(s, in_memory) for s in spans])

    def build(s: int):
        name, splits = SPLIT_NAMES[s], [p[s] for p in per_prefix]
        # The token count enters the cache description: another file of the same name and
        # sample count must not reuse this index.
        desc = f"{splits_string} ({data_impl}, {sum(t.num_tokens for t in splits)} tokens)"
        ranges = [np.arange(len(t), dtype=np.int32) for t in splits]
        if weights is not None:
            return _blend(name, prefixes, weights, ranges, splits, desc, num_samples[s],
                          seq_length, seed, common["data_cache_path"], common["lock_timeout_s"],
                          "--data-path")
        if len(splits[0]) == 0:
            return None
        return GPTDataset(name, prefixes[0], ranges[0], splits[0], desc, num_samples[s],
                          seq_length, seed, **common)

    return build


def _documents(bounds: list[int], split: int) -> np.ndarray:
    return np.arange(bounds[split], bounds[split + 1], dtype=np.int32)


def _split_dataset(s: int, prefix: str, indexed: MMapIndexedDataset, splits_string: str,
                   num_samples: int, seq_length: int, seed: int,
                   data_cache_path: Optional[str], lock_timeout_s: float
                   ) -> Optional[GPTDataset]:
    """Split s (train, valid, test) of one prefix, or None when it has no documents.

    Megatron splits the *sequences* of the .idx (for GPT data, one per document)."""
    bounds, name = get_train_valid_test_split_(splits_string, len(indexed.sizes)), SPLIT_NAMES[s]
    log_rank0("    %s: document indices in [%d, %d)", name, bounds[s], bounds[s + 1])
    if bounds[s + 1] <= bounds[s]:
        _warn_no_documents(prefix, name, splits_string, num_samples)
        return None
    return GPTDataset(name, prefix, _documents(bounds, s), indexed, splits_string, num_samples,
                      seq_length, seed, data_cache_path=data_cache_path,
                      lock_timeout_s=lock_timeout_s)


def _warn_no_documents(prefixes: str, name: str, splits_string: str, num_samples: int) -> None:
    logger.warning("%s: the %s split of --split %s has no documents; no %s dataset (%d "
                   "samples were asked for)", prefixes, name, splits_string, name, num_samples)


def _blend(name: str, prefixes: list[str], weights: list[float], doc_ranges: list[np.ndarray],
           indexed: list[MMapIndexedDataset], splits_string: str, num_samples: int,
           seq_length: int, seed: int, data_cache_path: Optional[str],
           lock_timeout_s: float, flag_name: str):
    """One split of a weighted blend, or None when no dataset has documents in it."""
    empty = [p for p, docs in zip(prefixes, doc_ranges) if len(docs) == 0]
    if len(empty) == len(prefixes):
        return None
    if empty:
        raise DataConfigError(
            f"{flag_name}: {', '.join(empty)} has no documents in the {name} split (--split "
            f"{splits_string}) but its weight asks for {name} samples")
    weights = normalize_weights(weights)
    requested = [int(math.ceil(num_samples * w * 1.005)) for w in weights]
    size = sum(requested)
    dataset_index, sample_index = build_blending_index_cached(
        weights, size, prefixes[0], data_cache_path, lock_timeout_s)
    # A dataset is asked for what the blend really draws from it, never less than Megatron's
    # ceil(n * w * 1.005), so tiny corpora and extreme weights cannot index past the end.
    drawn = np.bincount(np.asarray(dataset_index), minlength=len(prefixes))
    datasets = [
        GPTDataset(name, p, docs, ds, splits_string, max(req, int(got)), seq_length, seed,
                   data_cache_path=data_cache_path, lock_timeout_s=lock_timeout_s)
        for p, docs, ds, req, got in zip(prefixes, doc_ranges, indexed, requested, drawn)]
    return BlendedDataset(datasets, weights, size, dataset_index=dataset_index,
                          dataset_sample_index=sample_index)


def build_dataset(name: str, data_prefix: DataPath, data_impl: str, splits_string: str,
                  num_samples: int, seq_length: int, seed: int, skip_warmup: bool, *,
                  data_cache_path: Optional[str] = None, lock_timeout_s: float = 7200.0,
                  flag_name: Optional[str] = None, in_memory: bool = False):
    """A dataset over *all* documents of ``data_prefix`` (one prefix or a weighted blend);
    used for ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``."""
    flag_name = flag_name or f"--{name}-data-path"
    parsed = parse_data_path(data_prefix, flag_name)
    if parsed is None:
        return None
    prefixes, weights = parsed
    indexed = [_open(p, data_impl, skip_warmup, in_memory) for p in prefixes]
    ranges = [np.arange(len(ds.sizes), dtype=np.int32) for ds in indexed]
    if weights is None:
        if len(ranges[0]) == 0:
            raise DataConfigError(f"{flag_name}: {prefixes[0]} holds no documents")
        return GPTDataset(name, prefixes[0], ranges[0], indexed[0], splits_string, num_samples,
                          seq_length, seed, data_cache_path=data_cache_path,
                          lock_timeout_s=lock_timeout_s)
    empty = [p for p, r in zip(prefixes, ranges) if len(r) == 0]
    if empty:
        raise DataConfigError(f"{flag_name}: {', '.join(empty)} holds no documents")
    return _blend(name, prefixes, weights, ranges, indexed, splits_string, num_samples,
                  seq_length, seed, data_cache_path, lock_timeout_s, flag_name)


def build_train_valid_test_datasets(data_prefix: DataPath, data_impl: str, splits_string: str,
                                    train_valid_test_num_samples: Sequence[int],
                                    seq_length: int, seed: int, skip_warmup: bool,
                                    train_data_prefix: DataPath = None,
                                    valid_data_prefix: DataPath = None,
                                    test_data_prefix: DataPath = None,
                                    data_cache_path: Optional[str] = None, *,
                                    lock_timeout_s: float = 7200.0,
                                    in_memory: bool = False) -> tuple:
    """(train, valid, test) datasets, each a GPTDataset, a BlendedDataset or None.

    ``data_prefix`` is ``--data-path``: one prefix, or ``w1 p1 w2 p2 ...`` (list or one
    string), split by ``--split``.  Without it, ``--train/valid/test-data-path`` give each
    split its own prefix or blend, and the split string only enters the cache description.
    A split asked for 0 samples is None whatever the flags (``_wanted_splits``).
    """
    if len(train_valid_test_num_samples) != 3:
        raise DataConfigError("train_valid_test_num_samples must hold 3 counts")
    if seq_length < 1:
        raise DataConfigError(f"--seq-length must be positive, got {seq_length}")
    parsed = parse_data_path(data_prefix)
    common = dict(data_cache_path=data_cache_path, lock_timeout_s=lock_timeout_s)
    n = train_valid_test_num_samples
    if parsed is None:
        separate = (train_data_prefix, valid_data_prefix, test_data_prefix)
        if all(p is None for p in separate):
            raise DataConfigError("give --data-path or --train-data-path/--valid-data-path/"
                                  "--test-data-path")
        return _wanted_splits(n, lambda s: build_dataset(
            SPLIT_NAMES[s], separate[s], data_impl, splits_string, n[s], seq_length, seed,
            skip_warmup, in_memory=in_memory, **common))
    prefixes, weights = parsed
    if uses_token_files(prefixes, data_impl):
        return _wanted_splits(n, _token_file_builder(prefixes, weights, data_impl,
                                                     splits_string, n, seq_length, seed,
                                                     in_memory, common))
    indexed = [_open(p, data_impl, skip_warmup, in_memory) for p in prefixes]
    if weights is None:
        return _wanted_splits(n, lambda s: _split_dataset(
            s, prefixes[0], indexed[0], splits_string, n[s], seq_length, seed, **common))
    bounds = [get_train_valid_test_split_(splits_string, len(ds.sizes)) for ds in indexed]

    def blend_split(s: int):
        documents = [_documents(b, s) for b in bounds]
        if not any(len(d) for d in documents):  # as for one prefix
            _warn_no_documents(", ".join(prefixes), SPLIT_NAMES[s], splits_string, n[s])
            return None
        return _blend(SPLIT_NAMES[s], prefixes, weights, documents, indexed, splits_string,
                      n[s], seq_length, seed, data_cache_path, lock_timeout_s, "--data-path")

    return _wanted_splits(n, blend_split)


def _wanted_splits(num_samples: Sequence[int], build: Callable[[int], object]) -> tuple:
    """(train, valid, test), ``build(s)`` for each split asked for samples; a split asked for
    none (``--eval-iters 0``, or no test iterations) gets no dataset rather than an empty
    one, whichever data flags name it (a blend, one prefix, or per-split paths)."""
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        if num_samples[s] > 0:
            out.append(build(s))
        else:
            log_rank0(" > %s: no samples asked for, so no %s dataset", name, name)
            out.append(None)
    return tuple(out)


__all__ = [
    "GPTDataset", "build_dataset", "build_doc_idx", "build_index_arrays", "build_index_mappings",
    "build_shuffle_idx", "build_train_valid_test_datasets", "index_description",
    "num_epochs_needed", "num_tokens", "use_separate_last_epoch",
]

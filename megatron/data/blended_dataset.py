"""A weighted mixture of datasets (``--data-path 0.35 wiki 0.65 owt``).

Sample i of the blend is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``,
both from Megatron's greedy blend (``helpers.build_blending_indices``): each position goes to
the dataset furthest behind its weight, so any prefix of the blend matches the weights to
within one sample per dataset.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from megatron.data import helpers
from megatron.data.dataset_utils import (
    DataConfigError,
    IndexCache,
    description_hash,
    json_text,
    log_rank0,
    normalize_weights,
)

logger = logging.getLogger(__name__)


def build_blending_index(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index uint8|int16 [size], dataset_sample_index int64 [size]) for normalised
    ``weights``."""
    weights = np.asarray(weights, dtype=np.float64)
    index_dtype = np.uint8 if len(weights) < 255 else np.int16
    dataset_index = np.zeros(size, dtype=index_dtype)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if not helpers.cpp_available() and size > 5_000_000:
        logger.warning("building a %d-sample blend with the Python fallback; this takes minutes "
                       "(install a C++ compiler and re-run `pip install -e .`)", size)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights),
                                   size, verbose=False)
    return dataset_index, dataset_sample_index


def build_blending_index_cached(weights: Sequence[float], size: int, data_prefix: str,
                                data_cache_path: Optional[str] = None,
                                lock_timeout_s: float = 7200.0
                                ) -> tuple[np.ndarray, np.ndarray]:
    """``build_blending_index``, cached beside the index arrays of ``data_prefix``."""
    weights = [float(w) for w in weights]
    desc = f"Blending indices\n\nWeights: {[repr(w) for w in weights]}\nSize: {size}\n"
    key = description_hash(desc)
    names = [f"{key}_blend_index.npy", f"{key}_blend_sample_index.npy"]

    def build() -> dict[str, np.ndarray]:
        return dict(zip(names, build_blending_index(weights, size)))

    def validate(arrays: dict[str, np.ndarray]) -> Optional[str]:
        bad = [n for n in names if arrays[n].shape != (size,)]
        return f"{bad[0]} does not have {size} entries" if bad else None

    info = {"weights": weights, "size": size}
    cache = IndexCache(data_prefix, data_cache_path, lock_timeout_s=lock_timeout_s)
    arrays = cache.load_or_build(key, names, build, validate, extra_files={f"{key}.dsc": desc},
                                 optional_files={f"{key}.json": json_text(info)})
    return arrays[names[0]], arrays[names[1]]


def _dataset_label(dataset: Any, i: int) -> str:
    prefix, name = getattr(dataset, "data_prefix", None), getattr(dataset, "name", None)
    return f"{prefix} ({name})" if prefix else f"dataset {i}"


class BlendedDataset:
    """``datasets`` mixed by ``weights`` into ``size`` samples; ``ds[i]`` is the chosen
    dataset's sample dict plus ``dataset_idx``."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int, *,
                 data_cache_path: Optional[str] = None,
                 dataset_index: Optional[np.ndarray] = None,
                 dataset_sample_index: Optional[np.ndarray] = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataConfigError(f"blend of {len(datasets)} datasets needs as many weights, got "
                                  f"{len(weights)}")
        for i, (ds, w) in enumerate(zip(datasets, weights)):
            if not w > 0:
                raise DataConfigError(f"blend weight {w} of {_dataset_label(ds, i)} must be "
                                      "positive")
        self.datasets = list(datasets)
        self.weights = normalize_weights([float(w) for w in weights])
        self.size = int(size)
        if dataset_index is None or dataset_sample_index is None:
            prefix = getattr(datasets[0], "data_prefix", None)
            if data_cache_path is not None and prefix is not None:
                dataset_index, dataset_sample_index = build_blending_index_cached(
                    self.weights, self.size, prefix, data_cache_path)
            else:
                dataset_index, dataset_sample_index = build_blending_index(self.weights,
                                                                           self.size)
        if len(dataset_index) != self.size or len(dataset_sample_index) != self.size:
            raise DataConfigError(f"blending index has {len(dataset_index)} entries, expected "
                                  f"{self.size}")
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        self._check_enough_samples()
        self.desc = "Blended dataset\n\nDatasets:\n" + "".join(
            getattr(ds, "desc", _dataset_label(ds, i)) + "\n\n" for i, ds in enumerate(datasets))
        self.desc += f"Weights: {self.weights}\nSize: {self.size}\n"
        log_rank0("> blended dataset: %d samples from %d datasets", self.size, len(datasets))

    def _check_enough_samples(self) -> None:
        drawn = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for i, ds in enumerate(self.datasets):
            if drawn[i] > len(ds):
                raise DataConfigError(
                    f"the blend draws {drawn[i]} samples from {_dataset_label(ds, i)}, which has "
                    f"only {len(ds)}; build it with at least that many samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, Any]:
        i = int(idx)
        if not -self.size <= i < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        d = int(self.dataset_index[i])
        sample = self.datasets[d][int(self.dataset_sample_index[i])]
        return {"dataset_idx": np.int64(d), **sample}


BlendableDataset = BlendedDataset  # Megatron-DeepSpeed's name

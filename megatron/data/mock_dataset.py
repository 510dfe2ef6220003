"""Synthetic tokens for throughput runs (``--mock-data``): no files, deterministic per index."""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` uniform random ids, sample i seeded by
    ``(seed, i)`` so every rank and every resume sees the same sample at the same index."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234):
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(idx)])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}

"""Tiny corpora written with the builder, for the data tests."""

from __future__ import annotations

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


def write_corpus(prefix: str, doc_lengths, dtype=np.int32, seed: int = 0,
                 positional: bool = False, vocab: int = 1000) -> list[np.ndarray]:
    """One sequence per document; returns the documents. With ``positional`` each token is
    its position in the .bin, so tests can tell every token apart."""
    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    docs, pos = [], 0
    for n in doc_lengths:
        doc = np.arange(pos, pos + n) if positional else rng.integers(0, vocab, size=n)
        pos += n
        builder.add_item(doc)
        builder.end_document()
        docs.append(doc)
    builder.finalize(prefix + ".idx")
    return docs


def random_lengths(n: int, low: int = 1, high: int = 40, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(low, high, size=n)]

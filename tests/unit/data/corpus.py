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


def write_megatron_deepspeed_index(idx_path: str, sizes, doc_idx, code: int = 8) -> None:
    """An .idx as Megatron-DeepSpeed's MMapIndexedDataset.Index.writer writes it, spelled out
    here rather than through our writer: header, int32 sizes, int64 pointers that are the
    exclusive prefix sum of the sizes in bytes, int64 document index (code 8: uint16)."""
    import struct

    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 8: 2}[code]
    sizes = np.asarray(sizes, dtype=np.int64)
    pointers = np.concatenate(([0], np.cumsum(sizes * itemsize)[:-1])).astype("<i8")
    with open(idx_path, "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers[:len(sizes)].tobytes())
        f.write(np.asarray(doc_idx, dtype="<i8").tobytes())


def uncount_eods(prefix: str) -> None:
    """Rewrite the .idx of our --append-eod dataset at ``prefix`` the way Megatron-DeepSpeed's
    preprocess_data.py --append-eod writes it for the same input: the same .bin, each
    non-empty document's EOD left out of its last sequence's size."""
    from megatron.data.indexed_dataset import MMapIndexedDataset, dtype_code

    dataset = MMapIndexedDataset(prefix)
    sizes, doc_idx = np.array(dataset.sizes, dtype=np.int64), np.array(dataset.doc_idx)
    code = dtype_code(dataset.dtype)
    dataset.close()
    sizes[doc_idx[1:][np.diff(doc_idx) != 0] - 1] -= 1
    write_megatron_deepspeed_index(prefix + ".idx", sizes, doc_idx, code)

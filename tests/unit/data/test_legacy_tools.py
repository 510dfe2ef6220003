"""tools/inspect_dataset.py and tools/merge_datasets.py read legacy lazy/cached (TNTIDX) pairs."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.legacy_indexed_dataset import LegacyIndexedDatasetBuilder
from tools import inspect_dataset, merge_datasets

EOD = 0
# Documents as lists of sentences; the third is empty, every non-empty one ends with EOD.
LEGACY_DOCS = [[[5, 6, 7, EOD]], [[8, 9], [10, 11, EOD]], []]
MMAP_DOCS = [[[12, 13, EOD]], [[14, EOD]]]


def _write(builder, prefix: str, docs) -> str:
    for doc in docs:
        for sentence in doc:
            builder.add_item(np.array(sentence, dtype=np.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _legacy(tmp_path) -> str:
    prefix = str(tmp_path / "legacy_text_document")
    return _write(LegacyIndexedDatasetBuilder(prefix + ".bin"), prefix, LEGACY_DOCS)


def _flat(docs) -> list[list[int]]:
    return [[t for sentence in doc for t in sentence] for doc in docs]


@pytest.mark.parametrize("impl", [None, "lazy", "cached"])
def test_inspect_reads_a_legacy_pair(tmp_path, capsys, impl):
    prefix = _legacy(tmp_path)
    argv = [prefix, "--check", "--eod", str(EOD), "--docs", "2"]
    assert inspect_dataset.main(argv + (["--data-impl", impl] if impl else [])) == 0
    out = capsys.readouterr().out
    assert "format: legacy lazy/cached (TNTIDX)" in out and "dtype: int32" in out
    assert "sequences: 3" in out and "documents: 3" in out and "empty documents: 1" in out
    assert "tokens (sum of sizes): 9" in out and "tokens in .bin: 9" in out
    assert "document 1: 5 tokens: [8, 9, 10, 11, 0]" in out and "check: OK" in out


def test_inspect_finds_eod_problems_in_a_legacy_pair(tmp_path, capsys):
    # Read from the right offsets: document 1 starts with 8, so --eod 8 is misplaced there.
    assert inspect_dataset.main([_legacy(tmp_path), "--check", "--eod", "8"]) == 1
    out = capsys.readouterr().out
    assert "1 of the first 2 non-empty documents start with the EOD id 8" in out
    assert "check: FAILED" in out


def test_merge_takes_legacy_and_mmap_inputs(tmp_path):
    legacy_prefix = _legacy(tmp_path)
    mmap_prefix = str(tmp_path / "mmap_text_document")
    _write(MMapIndexedDatasetBuilder(mmap_prefix + ".bin", dtype=np.int32), mmap_prefix,
           MMAP_DOCS)
    out = str(tmp_path / "merged")
    assert merge_datasets.main(["--input", legacy_prefix, mmap_prefix,
                                "--output-prefix", out]) == 0
    merged = MMapIndexedDataset(out)
    assert merged.dtype == np.int32 and len(merged) == 5
    assert merged.doc_idx.tolist() == [0, 1, 3, 3, 4, 5]
    docs = [np.concatenate([merged[i] for i in range(a, b)] or [np.empty(0, np.int32)])
            for a, b in zip(merged.doc_idx[:-1], merged.doc_idx[1:])]
    assert [d.tolist() for d in docs] == _flat(LEGACY_DOCS) + _flat(MMAP_DOCS)
    merged.close()

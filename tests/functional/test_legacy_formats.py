"""Megatron's legacy lazy/cached datasets (TNTIDX): written by tools/preprocess_data.py
--dataset-impl, read by --data-impl lazy/cached/infer, converted to mmap by
tools/convert_legacy_dataset.py (issue 15, item 4)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset, make_dataset
from megatron.data.legacy_indexed_dataset import (
    LEGACY_MAGIC,
    LegacyIndexedDataset,
    LegacyIndexedDatasetBuilder,
)
from tests.functional.test_preprocess_data import preprocess, read_bytes, run_tool, write_jsonl
from tests.shared_data import gpt2_skip_reason, have_gpt2_files
from tests.unit.tokenizer.strings import VARIED_STRINGS, wikitext_paragraphs

pytestmark = [pytest.mark.shared_data,
              pytest.mark.skipif(not have_gpt2_files(), reason=gpt2_skip_reason() or "")]


def _megatron_deepspeed_idx(sizes, doc_idx, with_docs=True) -> bytes:
    """A legacy .idx laid out field by field as Megatron-DeepSpeed's builder writes it."""
    n = len(sizes)
    out = LEGACY_MAGIC + struct.pack("<Q", 1) + struct.pack("<QQ", 4, 4)
    out += struct.pack("<QQ", n, n)
    if with_docs:
        out += struct.pack("<Q", len(doc_idx))
    out += np.arange(n + 1, dtype="<i8").tobytes()
    out += np.concatenate(([0], np.cumsum(sizes))).astype("<i8").tobytes()
    out += np.asarray(sizes, dtype="<i8").tobytes()
    if with_docs:
        out += np.asarray(doc_idx, dtype="<i8").tobytes()
    return out


@pytest.fixture(scope="module")
def three_formats(tmp_path_factory):
    folder = tmp_path_factory.mktemp("legacy")
    texts = wikitext_paragraphs(30) + list(VARIED_STRINGS)
    records = [{"text": t} for t in texts if t.strip()][:40]
    source = write_jsonl(folder / "in.jsonl", records)
    prefixes = {}
    for impl in ("mmap", "lazy", "cached"):
        preprocess(source, folder / impl, "--append-eod", "--dataset-impl", impl, "--workers",
                   "1", *(["--partitions", "2"] if impl == "cached" else []))
        prefixes[impl] = str(folder / f"{impl}_text_document")
    return folder, prefixes


def test_builder_writes_megatron_deepspeeds_byte_layout(tmp_path):
    sizes, docs = [3, 2, 4], [0, 2, 3]
    builder = LegacyIndexedDatasetBuilder(str(tmp_path / "x.bin"))
    builder.add_item(np.array([1, 2, 3]))
    builder.add_item(np.array([4, 5]))
    builder.end_document()
    builder.add_doc(np.array([6, 7, 8, 9]), [4])
    builder.finalize(str(tmp_path / "x.idx"))
    assert read_bytes(tmp_path / "x.idx") == _megatron_deepspeed_idx(sizes, docs)
    assert read_bytes(tmp_path / "x.bin") == np.arange(1, 10, dtype="<i4").tobytes()
    # fairseq's original files have no document section: each item is a document.
    (tmp_path / "y.bin").write_bytes(read_bytes(tmp_path / "x.bin"))
    (tmp_path / "y.idx").write_bytes(_megatron_deepspeed_idx(sizes, docs, with_docs=False))
    old = LegacyIndexedDataset(str(tmp_path / "y"))
    assert old.doc_idx.tolist() == [0, 1, 2, 3] and old.get(2, 1, 2).tolist() == [7, 8]


def test_lazy_and_cached_read_back_equal_to_mmap(three_formats):
    _, prefixes = three_formats
    mmap = MMapIndexedDataset(prefixes["mmap"])
    assert len(mmap) > 10
    for impl in ("lazy", "cached", "infer"):
        legacy = make_dataset(prefixes["lazy" if impl == "infer" else impl], impl)
        assert isinstance(legacy, LegacyIndexedDataset)
        assert read_bytes(prefixes["lazy"] + ".idx")[:8] == LEGACY_MAGIC
        assert legacy.dtype == np.int32
        assert np.array_equal(legacy.sizes, mmap.sizes)
        assert np.array_equal(legacy.doc_idx, mmap.doc_idx)
        for i in range(len(mmap)):
            assert np.array_equal(legacy[i], mmap[i])
        assert legacy.get(3, 2, 4).tolist() == mmap.get(3, 2, 4).tolist()
    in_ram = make_dataset(prefixes["mmap"], "mmap", in_memory=True)  # --in-memory
    assert isinstance(in_ram._bin, bytes)
    assert all(np.array_equal(in_ram[i], mmap[i]) for i in range(len(mmap)))
    # The mmap reader names the format and the way out.
    with pytest.raises(IndexedDatasetError, match="--data-impl lazy"):
        MMapIndexedDataset(prefixes["lazy"])


def test_gpt_samples_of_legacy_and_mmap_are_equal(three_formats):
    folder, prefixes = three_formats
    built = {impl: build_train_valid_test_datasets(
        prefixes[impl], impl, "80,20,0", [30, 5, 0], 16, 7, True,
        data_cache_path=str(folder / f"cache-{impl}")) for impl in ("mmap", "lazy", "cached")}
    for impl in ("lazy", "cached"):
        for a, b in zip(built["mmap"][:2], built[impl][:2]):
            assert len(a) == len(b)
            for i in range(len(a)):
                assert np.array_equal(a[i]["text"], b[i]["text"])


def test_convert_to_mmap_round_trips_to_the_same_bytes(three_formats):
    folder, prefixes = three_formats
    out = str(folder / "converted")
    run_tool("convert_legacy_dataset.py", "--input", prefixes["cached"], "--output-prefix", out,
             "--dtype", "uint16")
    assert read_bytes(out + ".bin") == read_bytes(prefixes["mmap"] + ".bin")
    assert read_bytes(out + ".idx") == read_bytes(prefixes["mmap"] + ".idx")
    bad = run_tool("convert_legacy_dataset.py", "--input", prefixes["mmap"], "--output-prefix",
                   str(folder / "nope"), expect_ok=False)
    assert bad.returncode == 1 and "not a legacy lazy/cached index" in bad.stderr

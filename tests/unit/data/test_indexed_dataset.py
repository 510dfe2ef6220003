import logging
import os
import pickle
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.data import index_checks
from megatron.data import indexed_dataset as ix
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)


def _build(prefix, items, dtype, docs_after=None):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, item in enumerate(items):
        builder.add_item(item)
        if docs_after is None or i in docs_after:
            builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    prefix = str(tmp_path / "rt")
    rng = np.random.default_rng(0)
    high = 65000 if dtype == np.uint16 else 2**31 - 1
    items = [rng.integers(0, high, size=n) for n in (5, 1, 0, 17, 3)]
    _build(prefix, items, dtype, docs_after={1, 3, 4})
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 5 and ds.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ds.sizes, [5, 1, 0, 17, 3])
    np.testing.assert_array_equal(ds.doc_idx, [0, 2, 4, 5])
    for i, item in enumerate(items):
        np.testing.assert_array_equal(ds[i], item)
    np.testing.assert_array_equal(ds[-1], items[-1])
    for got, want in zip(ds[1:4], items[1:4]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds.get(3, offset=4, length=6), items[3][4:10])
    np.testing.assert_array_equal(ds.get(3, offset=10), items[3][10:])
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, offset=3, length=3)
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again[3], items[3])
    assert MMapIndexedDataset.exists(prefix) and not MMapIndexedDataset.exists(prefix + "x")


def test_idx_header_layout_field_by_field(tmp_path):
    prefix = str(tmp_path / "hdr")
    _build(prefix, [[1, 2, 3], [4, 5], [6]], np.uint16, docs_after={1, 2})
    raw = open(prefix + ".idx", "rb").read()
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 8  # uint16
    n, d = struct.unpack("<QQ", raw[18:34])
    assert (n, d) == (3, 3)
    assert struct.unpack("<3i", raw[34:46]) == (3, 2, 1)
    assert struct.unpack("<3q", raw[46:70]) == (0, 6, 10)  # byte offsets, 2 bytes per token
    assert struct.unpack("<3q", raw[70:94]) == (0, 2, 3)
    assert len(raw) == 94
    assert open(prefix + ".bin", "rb").read() == np.arange(1, 7, dtype="<u2").tobytes()


def _write_by_hand(prefix, code, itemsize, seqs):
    """An independent writer of the documented layout (as Megatron-LM/-DeepSpeed write it)."""
    sizes = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(seqs), len(seqs) + 1))
        f.write(struct.pack(f"<{len(seqs)}i", *sizes))
        f.write(struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(seqs) + 1}q", *range(len(seqs) + 1)))
    fmt = {1: "B", 4: "i", 5: "q", 6: "d", 7: "f" if itemsize == 4 else "d", 8: "H"}[code]
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(struct.pack(f"<{len(s)}{fmt}", *s))


@pytest.mark.parametrize("code,itemsize,dtype", [(1, 1, np.uint8), (4, 4, np.int32),
                                                 (5, 8, np.int64), (8, 2, np.uint16),
                                                 (6, 8, np.float64), (7, 4, np.float32),
                                                 (7, 8, np.float64)])
def test_reads_files_written_by_megatron_layout(tmp_path, code, itemsize, dtype):
    prefix = str(tmp_path / f"m{code}")
    seqs = [[1, 2, 3], [7], [9, 10]]
    _write_by_hand(prefix, code, itemsize, seqs)
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    for got, want in zip(ds[0:3], seqs):
        np.testing.assert_array_equal(got, want)


def test_add_doc_torch_and_list_inputs(tmp_path):
    prefix = str(tmp_path / "doc")
    b = ix.make_builder(prefix + ".bin", vocab_size=50257)
    assert b.dtype == np.uint16
    b.add_doc(np.arange(10), [4, 6])
    b.add_item(torch.tensor([10, 11]))
    b.add_item([12])
    b.end_document()
    b.finalize(prefix + ".idx")
    ds = ix.make_dataset(prefix, "mmap", skip_warmup=False)
    np.testing.assert_array_equal(ds.sizes, [4, 6, 2, 1])
    np.testing.assert_array_equal(ds.doc_idx, [0, 2, 4])
    np.testing.assert_array_equal(np.concatenate(ds[0:4]), np.arange(13))
    assert ix.best_fitting_dtype(65499) == np.uint16 and ix.best_fitting_dtype(65500) == np.int32
    assert ix.best_fitting_dtype(None) == np.int32


def test_token_that_does_not_fit_dtype_is_refused(tmp_path):
    b = MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="70000"):
        b.add_item(np.array([1, 70000]))
    with pytest.raises(ValueError, match="sum to"):
        b.add_doc([1, 2, 3], [1, 1])
    b.abort()
    assert os.listdir(tmp_path) == []


def test_merge(tmp_path):
    a, c, out = (str(tmp_path / n) for n in ("a", "c", "out"))
    _build(a, [[1, 2], [3]], np.int32, docs_after={0, 1})
    _build(c, [[4, 5, 6], [7]], np.int32, docs_after={1})
    ix.merge_datasets([a, c], out)
    ds = MMapIndexedDataset(out)
    np.testing.assert_array_equal(ds.sizes, [2, 1, 3, 1])
    np.testing.assert_array_equal(ds.doc_idx, [0, 1, 2, 4])
    np.testing.assert_array_equal(np.concatenate(ds[0:4]), np.arange(1, 8))


def test_interrupted_build_never_leaves_a_valid_pair(tmp_path):
    prefix = str(tmp_path / "crash")
    _build(prefix, [[1, 2, 3]], np.int32)  # an old complete pair
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_item(np.arange(100))
    # Until finalize the new data lives under .tmp names; the old pair stays intact.
    np.testing.assert_array_equal(MMapIndexedDataset(prefix)[0], [1, 2, 3])
    assert os.path.exists(prefix + ".bin.tmp")
    b.abort()
    assert not os.path.exists(prefix + ".bin.tmp")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_item(np.arange(100))
    b.end_document()
    b.finalize(prefix + ".idx")
    np.testing.assert_array_equal(MMapIndexedDataset(prefix)[0], np.arange(100))
    assert sorted(os.listdir(tmp_path)) == ["crash.bin", "crash.idx"]


def _corrupt(tmp_path, name, mutate_idx=None, mutate_bin=None):
    prefix = str(tmp_path / name)
    _build(prefix, [[1, 2, 3], [4, 5]], np.int32)
    for path, mutate in ((prefix + ".idx", mutate_idx), (prefix + ".bin", mutate_bin)):
        if mutate is not None:
            raw = bytearray(open(path, "rb").read())
            raw = mutate(raw)
            if raw is None:
                os.remove(path)
            else:
                open(path, "wb").write(bytes(raw))
    return prefix


def _set(offset, value):
    def mutate(raw):
        raw[offset:offset + len(value)] = value
        return raw
    return mutate


@pytest.mark.parametrize("case,kwargs,suffix,words", [
    ("magic", dict(mutate_idx=_set(0, b"XXIDIDX")), ".idx", "bad magic"),
    ("legacy", dict(mutate_idx=_set(0, b"TNTIDX\x00\x00\x01")), ".idx", "legacy"),
    ("version", dict(mutate_idx=_set(9, struct.pack("<Q", 2))), ".idx", "unknown version 2"),
    ("dtype", dict(mutate_idx=_set(17, bytes([9]))), ".idx", "unknown dtype code 9"),
    ("header", dict(mutate_idx=lambda r: r[:20]), ".idx", "truncated header"),
    ("short_idx", dict(mutate_idx=lambda r: r[:-9]), ".idx", "truncated"),
    ("short_bin", dict(mutate_bin=lambda r: r[:-4]), ".bin", "truncated"),
    ("no_bin", dict(mutate_bin=lambda r: None), ".bin", "missing .bin"),
    ("no_idx", dict(mutate_idx=lambda r: None), ".idx", "missing .idx"),
])
def test_corrupt_input_errors_name_the_file(tmp_path, case, kwargs, suffix, words):
    prefix = _corrupt(tmp_path, case, **kwargs)
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    assert prefix + suffix in str(err.value)
    assert words in str(err.value)


def test_unsupported_impl_is_an_error(tmp_path):
    with pytest.raises(IndexedDatasetError, match="'sparse' cannot open"):
        ix.make_dataset(str(tmp_path / "x"), "sparse")


def test_module_imports_without_torch():
    code = ("import sys; import megatron.data.indexed_dataset, megatron.data.helpers, "
            "megatron.data.gpt_dataset; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_abort_on_a_full_disk_still_removes_the_partial_file(tmp_path):
    """Closing a builder whose buffer cannot be flushed (ENOSPC) fails again inside abort():
    the partial .bin.tmp must still go, and abort must not raise over the first error."""
    import errno

    prefix = str(tmp_path / "full")
    builder = ix.make_builder(prefix + ".bin", vocab_size=100, atomic=True)
    builder.add_doc(np.arange(10), [10])
    real = builder._file

    class FullDisk:
        closed = False

        def close(self):
            real.close()
            self.closed = True
            raise OSError(errno.ENOSPC, "No space left on device")

    builder._file = FullDisk()
    builder.abort()
    assert os.listdir(tmp_path) == []


# Structural checks at open (issue 13, case 3): what inspect_dataset --check finds, the loader
# refuses, naming the file.


def _patch(path, offset, value):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(value)] = value
    open(path, "wb").write(bytes(raw))


def _uint16_docs(prefix, n=4):
    _build(prefix, [np.arange(10 * i, 10 * i + 5 + i) for i in range(n)], np.uint16)


@pytest.mark.parametrize("code,name", [(1, "uint8"), (4, "int32"), (5, "int64")])
def test_another_dtype_code_is_refused_naming_the_idx(tmp_path, code, name):
    prefix = str(tmp_path / "d")
    _uint16_docs(prefix)
    _patch(prefix + ".idx", 17, bytes([code]))
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    text = str(err.value)
    assert prefix + ".idx" in text and f"dtype code {code} ({name})" in text
    assert "2-byte tokens" in text


def test_another_dtype_code_of_a_one_sequence_dataset_names_the_bin(tmp_path):
    prefix = str(tmp_path / "one")
    _build(prefix, [np.arange(100)], np.uint16)
    _patch(prefix + ".idx", 17, bytes([1]))  # uint8: the .bin now looks twice too long
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    assert prefix + ".bin" in str(err.value) and "100 tokens of 2 bytes" in str(err.value)


def test_another_datasets_larger_bin_is_refused(tmp_path):
    small, large = str(tmp_path / "small"), str(tmp_path / "large")
    _uint16_docs(small, 3)
    _uint16_docs(large, 9)
    os.replace(large + ".bin", small + ".bin")
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(small)
    assert small + ".bin" in str(err.value) and "longer than the index" in str(err.value)


def _hand_index(prefix, sizes, doc_idx, pointers=None, dtype=np.uint16):
    """An .idx with any arrays (write_index computes consistent pointers), and its .bin."""
    ix.write_index(prefix + ".idx", dtype, np.asarray(sizes), np.asarray(doc_idx))
    if pointers is not None:
        _patch(prefix + ".idx", ix.HEADER_SIZE + 4 * len(sizes),
               np.asarray(pointers, dtype="<i8").tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.write(b"\0" * (int(np.sum(sizes)) * np.dtype(dtype).itemsize))


@pytest.mark.parametrize("sizes,doc_idx,pointers,words", [
    ([3, 2, 4], [0, 2, 1, 3], None, "decreases at entry 2"),
    ([3, 2, 4], [1, 3], None, "must start with 0"),
    ([3, 2, 4], [0, 5], None, "ends at sequence 5"),
    ([3, 2, 4], [0, 3], [0, 6, 8], "sequence 2 starts 2 bytes after sequence 1"),
    ([3, 2, 4], [0, 3], [2, 8, 12], "first sequence starts at byte 2"),
])
def test_inconsistent_index_arrays_are_refused(tmp_path, sizes, doc_idx, pointers, words):
    prefix = str(tmp_path / "h")
    _hand_index(prefix, sizes, doc_idx, pointers)
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    assert prefix + ".idx" in str(err.value) and words in str(err.value)


def test_loader_and_inspect_share_one_check(tmp_path, monkeypatch):
    """tools/inspect_dataset.py --check reports exactly what the loader refuses with."""
    from tools import inspect_dataset

    prefix = str(tmp_path / "d")
    _uint16_docs(prefix)
    _patch(prefix + ".idx", 17, bytes([1]))
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    problems = inspect_dataset.check(MMapIndexedDataset(prefix, verify=False), eod=None)
    assert len(problems) == 1 and problems[0] in str(err.value)
    calls = []
    monkeypatch.setattr(index_checks, "index_problems", lambda *a: calls.append(a) or [])
    MMapIndexedDataset(prefix)  # the loader goes through the shared function
    inspect_dataset.check(MMapIndexedDataset(prefix, verify=False), eod=None)
    assert len(calls) == 2


def test_checks_read_the_index_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(index_checks, "_CHECK_CHUNK", 3)
    prefix = str(tmp_path / "c")
    _build(prefix, [np.arange(i % 5) for i in range(20)], np.uint16)
    assert MMapIndexedDataset(prefix).problems() == []
    _hand_index(prefix, [1] * 20, [0, 20], pointers=[2 * i for i in range(19)] + [40])
    with pytest.raises(IndexedDatasetError, match="sequence 19 starts 4 bytes after"):
        MMapIndexedDataset(prefix)


# Megatron-DeepSpeed's --append-eod index (issue 22, item 1): the .bin holds each document's
# EOD, the sizes (and the pointers made from them) do not count it.

EOD = 50000
# Four documents: one sentence; none; two sentences; one sentence.
MDS_DOCS = [[[1, 2, 3]], [], [[4, 5], [6, 7, 8]], [[9]]]


def _megatron_deepspeed_pair(prefix, docs=MDS_DOCS):
    """Write ``docs`` as Megatron-DeepSpeed's preprocess_data.py --append-eod does; returns
    the .bin's tokens, the sizes and the pointers (in tokens) of its index."""
    from .corpus import write_megatron_deepspeed_index

    tokens, sizes, doc_idx = [], [], [0]
    for sentences in docs:
        for sentence in sentences:
            tokens += sentence
            sizes.append(len(sentence))
        if sentences:
            tokens.append(EOD)
        doc_idx.append(len(sizes))
    np.asarray(tokens, dtype=np.uint16).tofile(prefix + ".bin")
    write_megatron_deepspeed_index(prefix + ".idx", sizes, doc_idx)
    return tokens, sizes, [sum(sizes[:i]) for i in range(len(sizes))]


def test_megatron_deepspeed_append_eod_pair_is_read_as_megatron_deepspeed_reads_it(
        tmp_path, caplog):
    prefix = str(tmp_path / "mds")
    tokens, sizes, pointers = _megatron_deepspeed_pair(prefix)
    with caplog.at_level(logging.WARNING, logger="megatron"):
        ds = MMapIndexedDataset(prefix)
        MMapIndexedDataset(prefix)  # a run opens it again: no second warning
    # Megatron-DeepSpeed's reader: `size` tokens at the pointer the .idx holds.
    for i, (ptr, size) in enumerate(zip(pointers, sizes)):
        assert ds[i].tolist() == tokens[ptr:ptr + size]
    # Which means: a document starts k tokens early, after k uncounted EODs.
    assert [ds[i].tolist() for i in range(4)] == [[1, 2, 3], [EOD, 4], [5, 6, 7], [8]]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"{prefix}.idx is Megatron-DeepSpeed's preprocess_data.py --append-eod index: its "
        f"sizes leave out the EOD (id {EOD}) that ends each of its 3 non-empty documents in "
        f"{prefix}.bin. It is read as Megatron-DeepSpeed reads it, so samples equal "
        "Megatron-DeepSpeed's: document k starts k tokens before where it was written and "
        "ends that much short. To read every document as written, rewrite the index once: "
        f"python tools/inspect_dataset.py --fix-eod-index {prefix}")


@pytest.mark.parametrize("change,words", [
    ("one more token", "longer than the index describes"),
    ("one EOD replaced", "are not one EOD id (50000 after document 0, 7 after document 2"),
])
def test_a_pair_that_differs_from_megatron_deepspeeds_otherwise_is_refused(tmp_path, change,
                                                                           words):
    from megatron.data.eod_index import fix_uncounted_eod_index

    prefix = str(tmp_path / "mds")
    tokens, _, _ = _megatron_deepspeed_pair(prefix)
    if change == "one more token":
        tokens.append(EOD)
    else:
        tokens[9] = 7  # the EOD after document 2
    np.asarray(tokens, dtype=np.uint16).tofile(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match=re.escape(words)):
        MMapIndexedDataset(prefix)
    before = {n: open(tmp_path / n, "rb").read() for n in os.listdir(tmp_path)}
    with pytest.raises(IndexedDatasetError, match="is not a Megatron-DeepSpeed --append-eod "
                       "index, so nothing was changed: .*" + re.escape(words)):
        fix_uncounted_eod_index(prefix)
    assert {n: open(tmp_path / n, "rb").read() for n in os.listdir(tmp_path)} == before


def test_fix_eod_index_writes_what_our_builder_writes(tmp_path, caplog, monkeypatch):
    from megatron.data import eod_index

    prefix, ours = str(tmp_path / "mds"), str(tmp_path / "ours")
    _megatron_deepspeed_pair(prefix)
    original = open(prefix + ".idx", "rb").read()
    builder = MMapIndexedDatasetBuilder(ours + ".bin", dtype=np.uint16)
    for sentences in MDS_DOCS:  # our preprocess_data.py: the EOD counted in the last sentence
        lengths = [len(s) for s in sentences]
        if lengths:
            lengths[-1] += 1
        builder.add_doc([t for s in sentences for t in s] + [EOD] * bool(sentences), lengths)
    builder.finalize(ours + ".idx")
    # A failure while writing (a full disk) leaves the .idx as it was, and no temporary file.
    def write_half(path, *args):
        open(path, "wb").write(b"MMIDIDX")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eod_index, "write_index", write_half)
    with pytest.raises(OSError, match="No space left"):
        eod_index.fix_uncounted_eod_index(prefix)
    assert open(prefix + ".idx", "rb").read() == original
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    monkeypatch.undo()
    quirk, backup = eod_index.fix_uncounted_eod_index(prefix)
    assert (quirk.documents, quirk.eod) == (3, EOD)
    assert open(prefix + ".idx", "rb").read() == open(ours + ".idx", "rb").read()
    assert open(prefix + ".bin", "rb").read() == open(ours + ".bin", "rb").read()
    assert backup == prefix + ".idx.megatron-deepspeed" and open(backup, "rb").read() == original
    with caplog.at_level(logging.WARNING, logger="megatron"):
        ds = MMapIndexedDataset(prefix)
    assert not caplog.records
    assert [ds[i].tolist() for i in range(4)] == [[1, 2, 3, EOD], [4, 5], [6, 7, 8, EOD],
                                                  [9, EOD]]
    with pytest.raises(IndexedDatasetError, match="nothing was changed: its sizes already "
                       "count every token"):
        eod_index.fix_uncounted_eod_index(prefix)


def test_the_append_eod_signature_is_read_in_chunks_from_both_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(index_checks, "_CHECK_CHUNK", 3)
    monkeypatch.setattr(index_checks, "EOD_SAMPLE", 2)
    prefix = str(tmp_path / "mds")
    docs = [[[i + 1] * (1 + i % 3)] if i % 4 else [] for i in range(30)]  # every 4th empty
    tokens, _, _ = _megatron_deepspeed_pair(prefix, docs)
    assert MMapIndexedDataset(prefix).problems() == []
    quirk = ix.find_uncounted_eod(MMapIndexedDataset(prefix).index, prefix + ".bin",
                                  2 * len(tokens))
    assert (quirk.documents, quirk.eod) == (22, EOD)
    tokens[-1] = 7  # the EOD after the last document: among the two sampled at the end
    np.asarray(tokens, dtype=np.uint16).tofile(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match="7 after document 29"):
        MMapIndexedDataset(prefix)

"""tools/merge_preprocessed_data.py with Megatron-DeepSpeed's flags, as its tutorial spells
them (``--datasets ... --output-prefix ... --dataset-impl mmap``), beside our ``--input``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _make_dataset(prefix, docs):
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_doc(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(str(prefix) + ".idx")


def _merge(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools",
                                                        "merge_preprocessed_data.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag,extra", [("--datasets", ["--dataset-impl", "mmap"]),
                                        ("--input", [])])
def test_merge_preprocessed_data_takes_datasets_and_input(tmp_path, flag, extra):
    _make_dataset(tmp_path / "a_text_document", [[1, 2], [3]])
    _make_dataset(tmp_path / "b_text_document", [[4, 5, 6]])
    done = _merge(flag, tmp_path / "b_text_document", tmp_path / "a_text_document.bin",
                  "--output-prefix", tmp_path / "ab", *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    merged = MMapIndexedDataset(str(tmp_path / "ab"))
    assert [merged[i].tolist() for i in range(len(merged))] == [[4, 5, 6], [1, 2], [3]]
    assert merged.doc_idx.tolist() == [0, 1, 2, 3]


def test_merge_preprocessed_data_names_datasets_in_help():
    done = _merge("--help")
    assert done.returncode == 0 and "--datasets" in done.stdout


def _append_eod_pair(prefix, docs, eod=0):
    """A Megatron-DeepSpeed preprocess_data.py --append-eod pair of ``docs``: each document and
    its EOD in the .bin, the sizes without the EOD."""
    from tests.unit.data.corpus import uncount_eods

    _make_dataset(prefix, [doc + [eod] for doc in docs])
    uncount_eods(str(prefix))


def test_megatron_deepspeed_append_eod_pairs_merge_as_its_merge_does(tmp_path):
    """Megatron-DeepSpeed's merge_file_ copies each whole .bin and the sizes as they are: the
    output is byte for byte that, and reads (as Megatron-DeepSpeed reads it) its documents."""
    from tests.unit.data.corpus import write_megatron_deepspeed_index

    a, b = tmp_path / "a_text_document", tmp_path / "b_text_document"
    _append_eod_pair(a, [[5, 6, 7], [8]])
    _append_eod_pair(b, [[9, 10], [11, 12, 13]])
    done = _merge("--datasets", a, b, "--output-prefix", tmp_path / "ab")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Megatron-DeepSpeed --append-eod pairs: merged as its merge does" in done.stdout
    bins = [(p.parent / (p.name + ".bin")).read_bytes() for p in (a, b)]
    assert (tmp_path / "ab.bin").read_bytes() == bins[0] + bins[1]  # the EODs were dropped
    expected = tmp_path / "expected.idx"
    write_megatron_deepspeed_index(str(expected), [3, 1, 2, 3], [0, 1, 2, 3, 4])
    assert (tmp_path / "ab.idx").read_bytes() == expected.read_bytes()
    merged = MMapIndexedDataset(str(tmp_path / "ab"))  # recognised as such a pair, and read
    assert len(merged) == 4 and merged.doc_idx.tolist() == [0, 1, 2, 3, 4]
    # As Megatron-DeepSpeed reads it: document k starts k tokens early (its EODs uncounted).
    assert [merged[i].tolist() for i in range(4)] == [[5, 6, 7], [0], [8, 0], [9, 10, 0]]


def test_append_eod_pairs_mixed_with_counted_ones_are_refused_with_the_fix(tmp_path):
    a, b = tmp_path / "a_text_document", tmp_path / "b_text_document"
    _append_eod_pair(a, [[5, 6, 7], [8]])
    _make_dataset(b, [[9, 10, 0]])
    done = _merge("--datasets", a, b, "--output-prefix", tmp_path / "ab")
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]  # after the reader's warning about the pair
    assert message.startswith(f"error: {a}.idx: Megatron-DeepSpeed --append-eod index(es)")
    assert f"python tools/inspect_dataset.py --fix-eod-index {a}" in message
    assert not (tmp_path / "ab.bin").exists() and not (tmp_path / "ab.idx").exists()

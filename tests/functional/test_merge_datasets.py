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

"""tools/preprocess_data.py on local Hugging Face datasets (a save_to_disk folder, Parquet and
Arrow files) and with --shard-size / --max-documents (issue 15, item 3)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.functional.test_preprocess_data import preprocess, read_bytes, write_jsonl
from tests.shared_data import gpt2_skip_reason, have_gpt2_files
from tests.unit.tokenizer.strings import VARIED_STRINGS, wikitext_paragraphs

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = [pytest.mark.shared_data,
              pytest.mark.skipif(not have_gpt2_files(), reason=gpt2_skip_reason() or "")]


def _pair(prefix):
    return read_bytes(f"{prefix}.bin"), read_bytes(f"{prefix}.idx")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    texts = [t for t in wikitext_paragraphs(30) + list(VARIED_STRINGS) if t.strip()]
    texts = [f"{k}: {t}" for k in range(4) for t in texts][:60]
    assert len(texts) == 60
    texts.insert(3, "")  # an empty document, as dumps hold: no tokens, still a document
    ids = list(range(len(texts)))
    write_jsonl(folder / "in.jsonl", [{"text": t} for t in texts])
    preprocess(folder / "in.jsonl", folder / "json", "--append-eod")
    table = {"id": ids, "text": texts}
    dataset = datasets.Dataset.from_dict(table)
    datasets.DatasetDict({"train": dataset, "validation": dataset.select(range(5))}) \
        .save_to_disk(str(folder / "saved"))
    pq.write_table(pa.table(table), folder / "corpus.parquet", row_group_size=7)
    with pa.ipc.new_stream(str(folder / "corpus.arrow"), pa.table(table).schema) as writer:
        writer.write_table(pa.table(table))
    return folder, texts


@pytest.mark.parametrize("source,extra", [
    ("saved", ["--hf-split", "train"]),
    ("corpus.parquet", ["--workers", "2", "--chunk-size", "4"]),
    ("corpus.arrow", ["--partitions", "2"]),
])
def test_hf_inputs_give_the_bytes_of_the_json_lines(corpus, source, extra):
    folder, _ = corpus
    out = folder / f"out-{source}"
    proc = preprocess(folder / source, out, "--append-eod", "--hf-text-column", "text", *extra)
    assert "rows (Hugging Face dataset" in proc.stdout
    assert _pair(f"{out}_text_document") == _pair(folder / "json_text_document")


def test_shards_and_max_documents(corpus):
    folder, texts = corpus
    out = folder / "shards"
    proc = preprocess(folder / "corpus.parquet", out, "--append-eod", "--hf-text-column",
                      "text", "--shard-size", "20", "--max-documents", "50", "--workers", "2")
    assert "Done: 50 documents" in proc.stdout
    whole = MMapIndexedDataset(str(folder / "json_text_document"))
    shards = [MMapIndexedDataset(f"{out}_{k:05d}_text_document") for k in range(3)]
    assert [len(s.doc_idx) - 1 for s in shards] == [20, 20, 10]
    assert not os.path.exists(f"{out}_00003_text_document.idx")
    got = [s[i] for s in shards for i in range(len(s))]
    expected = whole[0:int(whole.doc_idx[50])]  # the first 50 documents' sequences
    assert len(got) == len(expected) == 49  # one document is empty
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_validation_split_and_bad_column_are_named(corpus):
    folder, _ = corpus
    proc = preprocess(folder / "saved", folder / "val", "--hf-split", "validation",
                      "--hf-text-column", "text")
    assert len(MMapIndexedDataset(f"{folder}/val_text_document").doc_idx) == 6
    bad = preprocess(folder / "corpus.parquet", folder / "bad", "--hf-text-column", "body",
                     expect_ok=False)
    assert bad.returncode == 1
    assert "corpus.parquet: no column 'body'" in bad.stderr and "'text'" in bad.stderr
    bad = preprocess(folder / "saved", folder / "bad", "--hf-split", "test", expect_ok=False)
    assert "choose one with --hf-split" in bad.stderr and proc.returncode == 0

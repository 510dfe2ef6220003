"""tools/preprocess_data.py, merge_datasets.py and inspect_dataset.py, driven as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.preprocess import Span, iter_chunks, plan_partitions
from tests.shared_data import gpt2_skip_reason, have_gpt2_files
from tests.unit.tokenizer.gpt2_reference import ReferenceGPT2
from tests.unit.tokenizer.strings import MERGES, VARIED_STRINGS, VOCAB, WIKITEXT

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EOD = 50256

pytestmark = [pytest.mark.shared_data,
              pytest.mark.skipif(not have_gpt2_files(), reason=gpt2_skip_reason() or "")]


def run_tool(script, *args, expect_ok=True):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", script), *map(str, args)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    if expect_ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def preprocess(inputs, prefix, *extra, expect_ok=True):
    inputs = inputs if isinstance(inputs, list) else [inputs]
    return run_tool(
        "preprocess_data.py", "--input", *inputs, "--output-prefix", prefix,
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES,
        *extra, expect_ok=expect_ok,
    )


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def reference():
    return ReferenceGPT2(VOCAB, MERGES)


@pytest.fixture(scope="module")
def corpus_texts():
    """Varied strings, JSON lists (pre-split documents), empty texts and WikiText lines."""
    texts = list(VARIED_STRINGS)
    texts += [["First sentence.", "", "Second <|endoftext|> sentence."], [], ["", ""]]
    if os.path.isfile(WIKITEXT):
        with open(WIKITEXT, encoding="utf-8") as f:
            texts += [line for line in f.read().split("\n")[:300]]
    return texts


def megatron_deepspeed_reference(texts, reference, append_eod=True):
    """Megatron-DeepSpeed's Encoder.encode + builder.add_doc, written out: tokenize each
    sentence, drop empty ones, append EOD to a document with tokens. Returns the .bin bytes,
    its sizes (which leave the EOD out) and its doc_idx."""
    tokens, sizes, doc_idx = [], [], [0]
    for text in texts:
        sentences = text if isinstance(text, list) else [text]
        doc, lengths = [], []
        for sentence in sentences:
            ids = reference.encode(sentence)
            if ids:
                doc.extend(ids)
                lengths.append(len(ids))
        if doc and append_eod:
            doc.append(EOD)
        tokens.extend(doc)
        sizes.extend(lengths)
        doc_idx.append(len(sizes))
    return np.array(tokens, dtype=np.uint16).tobytes(), sizes, doc_idx


def test_bin_matches_megatron_deepspeed_and_idx_counts_eod(tmp_path, corpus_texts, reference):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in corpus_texts])
    proc = preprocess(src, tmp_path / "out", "--append-eod", "--workers", "2",
                      "--chunk-size", "16", "--log-interval", "100")
    expected_bin, mds_sizes, mds_doc_idx = megatron_deepspeed_reference(corpus_texts, reference)
    assert read_bytes(tmp_path / "out_text_document.bin") == expected_bin
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.uint16
    assert dataset.doc_idx.tolist() == mds_doc_idx
    # Ours counts the EOD in each non-empty document's last sentence; Megatron-DeepSpeed's not.
    ours = dataset.sizes.tolist()
    last_sentences = {end - 1 for start, end in zip(mds_doc_idx, mds_doc_idx[1:]) if end > start}
    assert ours == [s + (i in last_sentences) for i, s in enumerate(mds_sizes)]
    assert sum(ours) * 2 == len(expected_bin)
    for d, text in enumerate(corpus_texts[:30]):
        start, end = mds_doc_idx[d], mds_doc_idx[d + 1]
        doc = np.concatenate([dataset[i] for i in range(start, end)] or [np.empty(0, np.uint16)])
        sentences = text if isinstance(text, list) else [text]
        want = [i for s in sentences for i in reference.encode(s)]
        assert doc.tolist() == (want + [EOD] if want else []), d
    progress = proc.stderr
    assert "Processed" in progress and "docs/s" in progress and "MB/s" in progress
    assert "tokens/s" in progress
    assert "Done:" in proc.stdout


def test_endoftext_literal_is_text_and_eod_only_from_flag(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "<|endoftext|>"}, {"text": "a"}])
    preprocess(src, tmp_path / "no_eod")
    tokens = np.frombuffer(read_bytes(tmp_path / "no_eod_text_document.bin"), np.uint16)
    assert EOD not in tokens.tolist()
    assert tokens.tolist() == [27, 91, 437, 1659, 5239, 91, 29, 64]
    preprocess(src, tmp_path / "eod", "--append-eod")
    tokens = np.frombuffer(read_bytes(tmp_path / "eod_text_document.bin"), np.uint16)
    assert tokens.tolist() == [27, 91, 437, 1659, 5239, 91, 29, EOD, 64, EOD]


def test_workers_and_partitions_give_identical_files(tmp_path, corpus_texts):
    records = [{"text": t, "title": str(i)} for i, t in enumerate(corpus_texts)]
    half = len(records) // 2
    write_jsonl(tmp_path / "part_a.jsonl", records[:half])
    write_jsonl(tmp_path / "part_b.jsonl", records[half:])
    glob_input = str(tmp_path / "part_*.jsonl")
    runs = {
        "w1": ["--workers", "1"],
        "w2": ["--workers", "2"],
        "p2": ["--workers", "2", "--partitions", "2"],
        "p3": ["--workers", "3", "--partitions", "3"],
    }
    for name, flags in runs.items():
        preprocess(glob_input, tmp_path / name, "--append-eod", "--chunk-size", "7",
                   "--json-keys", "text", "title", *flags)
    for key in ("text", "title"):
        for ext in ("bin", "idx"):
            files = {name: read_bytes(tmp_path / f"{name}_{key}_document.{ext}") for name in runs}
            assert len(set(files.values())) == 1, (key, ext)
    assert len(MMapIndexedDataset(str(tmp_path / "w1_title_document")).doc_idx) == len(records) + 1
    leftovers = [n for n in os.listdir(tmp_path) if "partition" in n or n.endswith(".tmp")]
    assert leftovers == []


def test_multiple_json_keys_each_get_a_dataset(tmp_path, reference):
    records = [{"text": "Body one.", "summary": "S1"}, {"text": "Body two!", "summary": ""}]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    preprocess(src, tmp_path / "out", "--json-keys", "text", "summary", "--append-eod")
    for key in ("text", "summary"):
        dataset = MMapIndexedDataset(str(tmp_path / f"out_{key}_document"))
        assert len(dataset.doc_idx) == 3
        for d, record in enumerate(records):
            ids = reference.encode(record[key])
            start, end = dataset.doc_idx[d], dataset.doc_idx[d + 1]
            got = [t for i in range(start, end) for t in dataset[i].tolist()]
            assert got == (ids + [EOD] if ids else [])


def test_json_list_is_a_pre_split_document(tmp_path, reference):
    sentences = ["One.", "", "Two two.", "Three"]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": sentences}])
    preprocess(src, tmp_path / "out", "--append-eod")
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    lengths = [len(reference.encode(s)) for s in sentences if s]
    lengths[-1] += 1  # the EOD
    assert dataset.sizes.tolist() == lengths
    assert dataset.doc_idx.tolist() == [0, 3]


def test_empty_text_is_an_empty_document(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"text": ""}, {"text": "b"}])
    preprocess(src, tmp_path / "out", "--append-eod")
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.doc_idx.tolist() == [0, 1, 1, 2]
    assert dataset.sizes.tolist() == [2, 2]


def test_split_sentences_offline(tmp_path):
    from megatron.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", VOCAB, MERGES)
    text = ("Mr. Smith went to Washington. He arrived on Tuesday.\n\nThe next day it rained! "
            "Did he stay? Yes.")
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": text}, {"text": ""}] * 20)
    first_doc = {}
    for name, flags in {"plain": [], "keep": ["--keep-newlines"]}.items():
        proc = preprocess(src, tmp_path / name, "--split-sentences", "--append-eod",
                          "--workers", "2", *flags)
        dataset = MMapIndexedDataset(str(tmp_path / f"{name}_text_sentence"))
        assert len(dataset.doc_idx) == 41
        first_doc[name] = [tokenizer.detokenize(dataset[i].tolist())
                           for i in range(dataset.doc_idx[1])]
        assert len(first_doc[name]) >= 4, "the document was not split into sentences"
        assert first_doc[name][-1].endswith("<|endoftext|>")
    assert not os.path.exists(tmp_path / "plain_text_document.bin")
    try:
        from nltk.tokenize.punkt import PunktTokenizer

        PunktTokenizer("english")
    except Exception:  # nltk's data is not installed here: the tool must have trained one
        assert "trained a Punkt model" in proc.stdout
    # --keep-newlines keeps the whitespace between sentences: they join back into the text.
    assert "".join(first_doc["keep"]) == text + "<|endoftext|>"
    assert all(s == s.strip() for s in first_doc["plain"])
    assert "".join(first_doc["plain"]) != "".join(first_doc["keep"])


@pytest.mark.parametrize(
    "line, reason",
    [
        (b'{"text": "unterminated}\n', "malformed JSON"),
        (b'{"title": "no text key"}\n', "missing key 'text'"),
        (b'{"text": "\xff\xfe bad bytes"}\n', "invalid UTF-8"),
        (b'{"text": 42}\n', "holds a number"),
        (b'["not", "an", "object"]\n', "expected a JSON object"),
        (b'{"text": "lone \\ud800 surrogate"}\n', "lone surrogate"),
    ],
    ids=["json", "key", "utf8", "type", "object", "surrogate"],
)
def test_bad_line_names_file_and_line_and_leaves_nothing(tmp_path, line, reason):
    # Partitions for two of the cases: the line number must count from the file's start.
    partitions = "2" if reason in ("malformed JSON", "invalid UTF-8") else "1"
    good = b'{"text": "fine"}\n'
    path = tmp_path / "c.jsonl"
    path.write_bytes(good * 30 + line + good * 5)
    proc = preprocess(str(path), tmp_path / "out", "--workers", "2", "--partitions",
                      partitions, "--chunk-size", "4", expect_ok=False)
    assert proc.returncode == 1
    assert f"{path}:31:" in proc.stderr and reason in proc.stderr, proc.stderr
    assert "--skip-bad-lines" in proc.stderr
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_skip_bad_lines_counts_them(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": bad}\n\n{"x": 1}\n{"text": "b"}\n{"text": "\xff"}\n')
    proc = preprocess(str(path), tmp_path / "out", "--skip-bad-lines", "--workers", "2")
    assert "Skipped 3 bad line(s)" in proc.stdout
    assert f"{path}:2: malformed JSON" in proc.stdout and f"{path}:4: missing key" in proc.stdout
    assert "Ignored 1 blank line(s)" in proc.stdout
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert len(dataset.doc_idx) == 3  # "a" and "b"


def test_errors_before_work_starts(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    cases = [
        (["--input", str(tmp_path / "nope_*.jsonl")], "matched no files"),
        (["--input", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--input", src, "--vocab-file", str(tmp_path / "v.json")], "--vocab-file"),
        (["--input", src, "--tokenizer-type", "WordPiece"], "--tokenizer-type"),
    ]
    for args, message in cases:
        base = {"--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": VOCAB,
                "--merge-file": MERGES, "--output-prefix": str(tmp_path / "out")}
        for flag, value in zip(args[::2], args[1::2]):
            base[flag] = value
        argv = [x for kv in base.items() for x in kv]
        proc = run_tool("preprocess_data.py", *argv, expect_ok=False)
        assert proc.returncode == 1 and message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_null_tokenizer_and_many_cores_alias(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "1 2 3"}, {"text": "69999"}])
    run_tool("preprocess_data_many_cores.py", "--input", src, "--output-prefix",
             tmp_path / "out", "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000",
             "--append-eod", "--workers", "2", "--partitions", "2")
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.int32  # 70001 ids do not fit uint16
    assert dataset[0].tolist() == [1, 2, 3, 70000] and dataset[1].tolist() == [69999, 70000]


def test_partition_plan_covers_every_line_once(tmp_path):
    rng = np.random.default_rng(0)
    for trial in range(60):
        files = []
        for j in range(int(rng.integers(1, 4))):
            lines = [b"x" * int(rng.integers(0, 30)) + b"\n" for _ in range(rng.integers(0, 7))]
            data = b"".join(lines)
            if data and rng.random() < 0.3:
                data = data[:-1]  # no newline at the end of the file
            path = tmp_path / f"t{trial}_f{j}.jsonl"
            path.write_bytes(data)
            files.append(str(path))
        whole = [(s.path, line) for s in map(Span, files)
                 for chunk in iter_chunks([s], 3) for line in chunk.lines]
        for partitions in range(1, 6):
            pieces = plan_partitions(files, partitions)
            assert len(pieces) <= partitions
            got = []
            for spans in pieces:
                for chunk in iter_chunks(spans, 2):
                    span = spans[chunk.span_index]
                    file_lines = open(span.path, "rb").read().splitlines(keepends=True)
                    for k, line in enumerate(chunk.lines):
                        assert file_lines[span.line_number(chunk.first_line + k) - 1] == line
                        got.append((span.path, line))
            assert got == whole, (trial, partitions)


def _make_dataset(prefix, docs, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_doc(np.array(doc, dtype=dtype), [len(doc)] if doc else [])
    builder.finalize(str(prefix) + ".idx")


def test_merge_preserves_documents_and_order(tmp_path):
    parts = [[[1, 2], [3]], [[]], [[4, 5, 6], [7]]]
    (tmp_path / "shards").mkdir()
    for i, docs in enumerate(parts):
        _make_dataset(tmp_path / "shards" / f"s{i}", docs)
    run_tool("merge_datasets.py", "--input", tmp_path / "shards", "--output-prefix",
             tmp_path / "all")
    merged = MMapIndexedDataset(str(tmp_path / "all"))
    assert merged.doc_idx.tolist() == [0, 1, 2, 2, 3, 4]
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4, 5, 6], [7]]
    run_tool("merge_preprocessed_data.py", "--input", tmp_path / "shards" / "s2",
             tmp_path / "shards" / "s0.idx", "--output-prefix", tmp_path / "two")
    two = MMapIndexedDataset(str(tmp_path / "two"))
    assert [two[i].tolist() for i in range(len(two))] == [[4, 5, 6], [7], [1, 2], [3]]


def test_merge_refuses_mixed_dtypes(tmp_path):
    _make_dataset(tmp_path / "small", [[1, 2]], np.uint16)
    _make_dataset(tmp_path / "big", [[70000]], np.int32)
    proc = run_tool("merge_datasets.py", "--input", tmp_path / "small", tmp_path / "big",
                    "--output-prefix", tmp_path / "out", expect_ok=False)
    assert proc.returncode == 1
    assert "small.idx (uint16)" in proc.stderr and "big.idx (int32)" in proc.stderr
    assert not any(name.startswith("out") for name in os.listdir(tmp_path))


def test_inspect_and_fix_megatron_deepspeed_append_eod_index(tmp_path, corpus_texts):
    """Issue 22 item 1: Megatron-DeepSpeed's --append-eod pair (its index written as it
    writes it, beside the same .bin as ours) is shown with the warning; --fix-eod-index makes
    its .idx the one our preprocess_data.py writes, atomically, keeping the original."""
    from tests.unit.data.corpus import uncount_eods

    src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in corpus_texts])
    preprocess(src, tmp_path / "ours", "--append-eod")
    ours, mds = str(tmp_path / "ours_text_document"), str(tmp_path / "mds")
    for suffix in (".bin", ".idx"):
        shutil.copy(ours + suffix, mds + suffix)
    uncount_eods(mds)
    written = read_bytes(mds + ".idx")
    shown = run_tool("inspect_dataset.py", mds, "--check", "--eod", EOD)
    assert "WARNING: " + mds + ".idx is Megatron-DeepSpeed's preprocess_data.py --append-eod " \
        "index" in shown.stdout
    assert f"--fix-eod-index {mds}" in shown.stdout and "check: OK" in shown.stdout
    fixed = run_tool("inspect_dataset.py", "--fix-eod-index", mds)
    nonempty = int(np.count_nonzero(np.diff(MMapIndexedDataset(ours).doc_idx)))
    assert fixed.stdout == (
        f"{mds}.idx: rewritten to count the EOD (id {EOD}) of each of its {nonempty} non-empty "
        f"documents; the .bin is unchanged, and the original index is kept as "
        f"{mds}.idx.megatron-deepspeed\n")
    assert read_bytes(mds + ".idx") == read_bytes(ours + ".idx")
    assert read_bytes(mds + ".idx.megatron-deepspeed") == written
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["c.jsonl", "ours_text_document.bin", "ours_text_document.idx", "mds.bin", "mds.idx",
         "mds.idx.megatron-deepspeed"])
    assert "check: OK" in run_tool("inspect_dataset.py", mds, "--check", "--eod", EOD).stdout
    again = run_tool("inspect_dataset.py", "--fix-eod-index", mds, expect_ok=False)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == (f"error: --fix-eod-index: {mds}.idx is not a Megatron-DeepSpeed "
                            "--append-eod index, so nothing was changed: its sizes already "
                            "count every token\n")
    assert read_bytes(mds + ".idx") == read_bytes(ours + ".idx")


def test_tool_never_imports_torch_or_transformers(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "light start"}])
    code = (
        "import sys; sys.path.insert(0, 'tools'); import preprocess_data; "
        f"rc = preprocess_data.main(['--input', {src!r}, '--output-prefix', "
        f"{str(tmp_path / 'out')!r}, '--tokenizer-type', 'GPT2BPETokenizer', "
        f"'--vocab-file', {VOCAB!r}, '--merge-file', {MERGES!r}, '--workers', '2']); "
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]; "
        "print('heavy', heavy); sys.exit(rc or bool(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "heavy []" in proc.stdout

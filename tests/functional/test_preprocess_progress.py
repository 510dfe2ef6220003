"""tools/preprocess_data.py's progress lines: percent done and ETA when the input's size is
known (plain files: bytes read / file size), at --log-interval documents; none for gzip."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

from megatron.data.preprocess.encoding import ChunkResult
from megatron.data.preprocess.reading import Span, input_size
from megatron.data.preprocess.writing import ProgressLog

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LINE = re.compile(r"^(\[partition \d/\d\] )?Processed (\d+) documents, ([\d.]+)% done, "
                  r"ETA (\d+:\d\d:\d\d) \(.*docs/s.*MB/s.*\)\.$")


def _corpus(path, documents=2000):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(documents):
            f.write(json.dumps({"text": " ".join(str((7 * i + j) % 100) for j in range(20))})
                    + "\n")
    return path


def _preprocess(source, prefix, *extra):
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
         str(source), "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128", "--chunk-size", "50", "--log-interval", "400", *extra],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stderr.splitlines() if "Processed" in line]


def test_progress_lines_show_percent_and_eta(tmp_path):
    lines = _preprocess(_corpus(tmp_path / "c.jsonl"), tmp_path / "out")
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    assert [int(m.group(2)) for m in matches] == [400, 800, 1200, 1600, 2000]
    # Equal documents: the bytes read grow as the documents do.
    assert [float(m.group(3)) for m in matches] == [20.0, 40.0, 60.0, 80.0, 100.0]
    assert matches[-1].group(4) == "0:00:00"


def test_each_partition_reports_its_own_part(tmp_path):
    lines = _preprocess(_corpus(tmp_path / "c.jsonl"), tmp_path / "out", "--partitions", "2",
                        "--workers", "2", "--log-interval", "500")
    matches = [LINE.match(line) for line in lines]
    assert all(matches) and len(matches) == 4, lines
    for label in ("[partition 1/2] ", "[partition 2/2] "):
        assert [float(m.group(3)) for m in matches if m.group(1) == label] == [50.0, 100.0]


def test_gzip_input_has_no_percent(tmp_path):
    source = _corpus(tmp_path / "c.jsonl")
    with open(source, "rb") as f, gzip.open(tmp_path / "c.jsonl.gz", "wb") as g:
        g.write(f.read())
    lines = _preprocess(tmp_path / "c.jsonl.gz", tmp_path / "out")
    assert len(lines) == 5 and not any("% done" in line for line in lines), lines


def test_eta_is_the_rest_at_the_rate_so_far(monkeypatch, capsys, tmp_path):
    clock = iter([100.0, 110.0])  # start, then 10 s later
    monkeypatch.setattr("megatron.data.preprocess.writing.time.time", lambda: next(clock))
    progress = ProgressLog(interval=5, total_bytes=1000)
    progress.update(ChunkResult(0, 0, documents=5, input_bytes=250), [Span("x")])
    assert "Processed 5 documents, 25.0% done, ETA 0:00:30 (" in capsys.readouterr().err
    # A span from a byte offset counts only its own bytes.
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert input_size([Span(str(path), 30), Span(str(path), 0, 10)]) == 80
    assert input_size([Span(str(path)), Span(str(path) + ".gz")]) is None

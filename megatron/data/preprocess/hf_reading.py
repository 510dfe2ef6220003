"""Reading local Hugging Face datasets: a ``save_to_disk`` folder, or Parquet / Arrow files.

Each row becomes the JSON line ``{"<column>": <value>, ...}`` of the ``--json-keys`` columns
(``--hf-text-column`` names one), and flows through the same encoder as a JSON-lines file, so
a dataset and its JSON-lines export give byte-identical ``.bin``/``.idx`` files. Rows are read
in Arrow record batches (memory-mapped for Arrow files and ``save_to_disk`` folders), never the
whole table at once, and nothing touches the network (``HF_DATASETS_OFFLINE=1``): the
Wikipedia, OpenWebText and FineWeb dumps users keep on disk preprocess where they are.

A span of an HF input counts rows, not bytes: ``HFSpan(path, start_row, end_row)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from megatron.data.preprocess.config import InputError
from megatron.data.preprocess.reading import Chunk, Span, iter_chunks

BATCH_ROWS = 1024


@dataclass(frozen=True)
class HFSpan(Span):
    """Rows ``[start, end)`` of one HF input; ``split`` picks a DatasetDict's split."""

    split: Optional[str] = None


def _import(module: str):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise InputError(f"reading Hugging Face datasets needs {module.split('.')[0]}: pip "
                         "install 'megatron-gpt[hf-data]' (datasets, pyarrow)") from None


def load_table_source(path: str, split: Optional[str]) -> Any:
    """An object with ``num_rows``, ``column_names`` and ``batches(start, end, columns)``."""
    if os.path.isdir(path):
        return _SavedDataset(path, split)
    if path.endswith(".parquet"):
        return _ParquetFile(path)
    return _ArrowFile(path)


class _SavedDataset:
    def __init__(self, path: str, split: Optional[str]) -> None:
        datasets = _import("datasets")
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as e:  # datasets raises several types for a damaged folder
            raise InputError(f"--input {path}: cannot load the saved dataset ({e})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split is None:
                split = "train" if "train" in loaded else None
            if split not in loaded:
                raise InputError(f"--input {path}: a DatasetDict with splits "
                                 f"{sorted(loaded)}; choose one with --hf-split")
            loaded = loaded[split]
        elif split is not None and split != str(loaded.split or split):
            raise InputError(f"--input {path}: --hf-split {split!r} but the folder holds one "
                             f"dataset (split {loaded.split!r})")
        self.dataset = loaded
        self.num_rows, self.column_names = len(loaded), list(loaded.column_names)

    def batches(self, start: int, end: int, columns: Sequence[str]) -> Iterator[dict]:
        dataset = self.dataset.select_columns(list(columns))
        for lo in range(start, end, BATCH_ROWS):
            yield dataset[lo:min(end, lo + BATCH_ROWS)]


class _ParquetFile:
    def __init__(self, path: str) -> None:
        pq = _import("pyarrow.parquet")
        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:
            raise InputError(f"--input {path}: not a readable Parquet file ({e})") from None
        self.num_rows = self.file.metadata.num_rows
        self.column_names = list(self.file.schema_arrow.names)

    def batches(self, start: int, end: int, columns: Sequence[str]) -> Iterator[dict]:
        row = 0
        for batch in self.file.iter_batches(batch_size=BATCH_ROWS, columns=list(columns)):
            lo, hi = max(start - row, 0), min(end - row, batch.num_rows)
            if hi > lo:
                yield batch.slice(lo, hi - lo).to_pydict()
            row += batch.num_rows
            if row >= end:
                return


class _ArrowFile:
    """An Arrow IPC file or stream (``datasets`` writes streams) read through a memory map."""

    def __init__(self, path: str) -> None:
        pa = _import("pyarrow")
        try:
            source = pa.memory_map(path)
            try:
                self.table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                self.table = pa.ipc.open_stream(pa.memory_map(path)).read_all()
        except Exception as e:
            raise InputError(f"--input {path}: not a readable Arrow file ({e})") from None
        self.num_rows, self.column_names = self.table.num_rows, list(self.table.column_names)

    def batches(self, start: int, end: int, columns: Sequence[str]) -> Iterator[dict]:
        table = self.table.select(list(columns))
        for lo in range(start, end, BATCH_ROWS):
            yield table.slice(lo, min(end, lo + BATCH_ROWS) - lo).to_pydict()


def check_hf_input(path: str, split: Optional[str], columns: Sequence[str]) -> int:
    """Open ``path`` and check that it has ``columns``; returns its row count."""
    source = load_table_source(path, split)
    missing = [c for c in columns if c not in source.column_names]
    if missing:
        raise InputError(f"--input {path}: no column {', '.join(map(repr, missing))} "
                         f"(--hf-text-column / --json-keys); it has {source.column_names}")
    return source.num_rows


def iter_hf_chunks(span: HFSpan, span_index: int, chunk_lines: int,
                   columns: Sequence[str]) -> Iterator[Chunk]:
    """The rows of ``span`` as chunks of JSON lines (``chunk_lines`` rows at most)."""
    source = load_table_source(span.path, span.split)
    end = source.num_rows if span.end is None else span.end
    lines: list[bytes] = []
    first = 0
    for batch in source.batches(span.start, end, columns):
        for values in zip(*(batch[c] for c in columns)):
            record = dict(zip(columns, values))
            lines.append(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
            if len(lines) == chunk_lines:
                yield Chunk(span_index, first, lines)
                first += len(lines)
                lines = []
    if lines:
        yield Chunk(span_index, first, lines)


def iter_input_chunks(spans: Sequence[Span], chunk_lines: int,
                      columns: Sequence[str]) -> Iterator[Chunk]:
    """Chunks of every span in order: JSON-lines files as they are, HF inputs row by row."""
    for span_index, span in enumerate(spans):
        if isinstance(span, HFSpan):
            yield from iter_hf_chunks(span, span_index, chunk_lines, columns)
        else:
            for chunk in iter_chunks([span], chunk_lines):
                yield Chunk(span_index, chunk.first_line, chunk.lines)


def plan_hf_partitions(spans: Sequence[HFSpan], rows: Sequence[int],
                       partitions: int) -> list[list[HFSpan]]:
    """Cut the inputs' rows into ``partitions`` contiguous pieces of about equal row counts."""
    total = sum(rows)
    cuts = [total * k // partitions for k in range(partitions + 1)]
    pieces = []
    for lo, hi in zip(cuts, cuts[1:]):
        piece, base = [], 0
        for span, n in zip(spans, rows):
            a, b = max(lo, base), min(hi, base + n)
            if b > a:
                piece.append(HFSpan(span.path, a - base, b - base, a - base, span.split))
            base += n
        if piece:
            pieces.append(piece)
    return pieces

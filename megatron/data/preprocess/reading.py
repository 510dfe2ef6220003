"""Reading: spans of input files, cut into chunks of whole lines, and the partition plan."""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

from megatron.data.preprocess.config import InputError

CHUNK_BYTES = 1 << 20  # a work item holds at most this much input (and --chunk-size lines)


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of one input file (``end`` None: to the end; gzip is whole)."""

    path: str
    start: int = 0
    end: Optional[int] = None
    lines_before: Optional[int] = 0  # lines before ``start``; None until an error needs it

    def line_number(self, line_in_span: int) -> int:
        """1-based line number in the file of the span's 0-based line ``line_in_span``."""
        before = self.lines_before
        if before is None:
            before = _count_newlines(self.path, self.start)
        return before + line_in_span + 1


@dataclass
class Chunk:
    span_index: int
    first_line: int  # 0-based line of lines[0] within its span
    lines: list[bytes]


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _count_newlines(path: str, end: int) -> int:
    count = 0
    with open(path, "rb") as f:
        while end > 0:
            block = f.read(min(end, 16 << 20))
            if not block:
                break
            count += block.count(b"\n")
            end -= len(block)
    return count


def input_size(spans: Sequence[Span]) -> Optional[int]:
    """Bytes the spans hold, which is what the encoder counts as read; None when unknown
    (a gzip file's decompressed size is not known before it has been read)."""
    total = 0
    for span in spans:
        if span.path.endswith(".gz") or type(span) is not Span:  # rows of an HF dataset
            return None
        end = os.path.getsize(span.path) if span.end is None else span.end
        total += end - span.start
    return total


def iter_chunks(spans: Sequence[Span], chunk_lines: int) -> Iterator[Chunk]:
    """Whole lines of each span in order, at most ``chunk_lines`` lines / ~1 MiB per chunk."""
    for span_index, span in enumerate(spans):
        try:
            yield from _span_chunks(span, span_index, chunk_lines)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            # gzip's own messages name no file; a cut-off download is the usual cause.
            raise InputError(f"{span.path}: cannot decompress ({e}); the file is truncated "
                             "or not gzip") from None


def _span_chunks(span: Span, span_index: int, chunk_lines: int) -> Iterator[Chunk]:
    with _open_binary(span.path) as f:
        if span.start:
            f.seek(span.start)
        remaining = None if span.end is None else span.end - span.start
        line_in_span = 0
        while remaining is None or remaining > 0:
            hint = CHUNK_BYTES if remaining is None else min(CHUNK_BYTES, remaining)
            lines = f.readlines(hint)
            if not lines:
                break
            if remaining is not None:
                # readlines stops only once it is past the hint: give back the lines of
                # the next span (span ends fall on line ends).
                size = sum(map(len, lines))
                while size > remaining:
                    size -= len(lines.pop())
                remaining = remaining - size if lines else 0
            for i in range(0, len(lines), chunk_lines):
                yield Chunk(span_index, line_in_span + i, lines[i : i + chunk_lines])
            line_in_span += len(lines)


def plan_partitions(files: Sequence[str], partitions: int) -> list[list[Span]]:
    """Cut the concatenated input into ``partitions`` contiguous, line-aligned pieces.

    Pieces are about equal in bytes; a gzip file is never cut. Empty pieces are dropped, so
    fewer partitions may come back for tiny inputs.
    """
    sizes = [os.path.getsize(p) for p in files]
    total = sum(sizes)
    # A cut is (file index, offset of a line start in that file); (len(files), 0) is the end.
    cuts = {_line_aligned_cut(files, sizes, total * k // partitions) for k in range(1, partitions)}
    bounds = [(0, 0), *sorted(cuts), (len(files), 0)]
    pieces = []
    for (f0, o0), (f1, o1) in zip(bounds, bounds[1:]):
        spans = []
        for i in range(f0, f1 + (o1 > 0)):
            start = o0 if i == f0 else 0
            end = o1 if i == f1 else None
            if (sizes[i] if end is None else end) > start:
                spans.append(Span(files[i], start, end, 0 if start == 0 else None))
        if spans:
            pieces.append(spans)
    return pieces


def _line_aligned_cut(files: Sequence[str], sizes: Sequence[int], target: int) -> tuple[int, int]:
    for i, size in enumerate(sizes):
        if target < size:
            if files[i].endswith(".gz") or target == 0:
                return (i, 0)
            with open(files[i], "rb") as f:
                f.seek(target - 1)
                f.readline()  # to the end of the line holding byte target-1
                offset = f.tell()
            return (i, offset) if offset < size else (i + 1, 0)
        target -= size
    return (len(files), 0)

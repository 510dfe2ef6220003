"""Writing (main process): one dataset per JSON key, progress lines and run statistics."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron.data import indexed_dataset
from megatron.data.preprocess.config import OutputError, PreprocessConfig
from megatron.data.preprocess.encoding import ChunkResult, KeyArrays
from megatron.data.preprocess.reading import Span
from megatron.platform.progress import percent_and_eta

MAX_SKIP_EXAMPLES = 10


class DatasetWriter:
    """One builder per JSON key; files stay under temporary names until ``finalize``.

    An OSError while writing (a full disk, a lost mount) becomes an ``OutputError`` naming the
    output, and ``abort`` removes every temporary file even when closing them fails too.
    """

    def __init__(self, config: PreprocessConfig, prefix: str, vocab_size: int):
        self.paths = {key: config.output_name(prefix, key) for key in config.json_keys}
        self.builders = {}
        try:
            for key, path in self.paths.items():
                with self._writing(key):
                    self.builders[key] = indexed_dataset.make_builder(
                        indexed_dataset.data_file_path(path), impl=config.dataset_impl,
                        vocab_size=vocab_size
                    )
        except BaseException:
            self.abort()
            raise

    @contextlib.contextmanager
    def _writing(self, key: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            path = indexed_dataset.data_file_path(self.paths[key])
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None

    def add(self, result: ChunkResult) -> None:
        for key, arrays in result.keys.items():
            builder = self.builders[key]
            token_ends = np.cumsum(arrays.doc_tokens).tolist()
            sentence_ends = np.cumsum(arrays.doc_sentences).tolist()
            t0 = s0 = 0
            with self._writing(key):
                for t1, s1 in zip(token_ends, sentence_ends):
                    builder.add_doc(arrays.tokens[t0:t1], arrays.sizes[s0:s1])
                    t0, s0 = t1, s1

    def merge(self, prefix: str, config: PreprocessConfig) -> None:
        for key, builder in self.builders.items():
            with self._writing(key):
                builder.merge_file_(config.output_name(prefix, key))

    def finalize(self) -> None:
        for key, builder in self.builders.items():
            with self._writing(key):
                builder.finalize(indexed_dataset.index_file_path(self.paths[key]))

    def abort(self) -> None:
        """Delete the partial outputs; never raises, so the error that caused it shows."""
        for builder in self.builders.values():
            # A removal that fails here is tried again, and reported, by remove_files below.
            with contextlib.suppress(OSError):
                builder.abort()
        for path in self.paths.values():
            remove_files(indexed_dataset.data_file_path(path) + ".tmp",
                         indexed_dataset.index_file_path(path) + ".tmp")


def slice_result(result: ChunkResult, first: int, last: int) -> ChunkResult:
    """Documents ``[first, last)`` of ``result`` (its statistics stay with the original)."""
    keys = {}
    for key, a in result.keys.items():
        t0, t1 = int(a.doc_tokens[:first].sum()), int(a.doc_tokens[:last].sum())
        s0, s1 = int(a.doc_sentences[:first].sum()), int(a.doc_sentences[:last].sum())
        keys[key] = KeyArrays(a.tokens[t0:t1], a.sizes[s0:s1], a.doc_sentences[first:last],
                              a.doc_tokens[first:last])
    return ChunkResult(result.span_index, result.first_line, keys=keys)


def shard_prefix(prefix: str, shard: int) -> str:
    """``--shard-size``: shard k's datasets are ``{prefix}_{k:05d}_{key}_{level}``."""
    return f"{prefix}_{shard:05d}"


class ShardedWriter:
    """``--shard-size N`` (a new dataset every N documents) and ``--max-documents M`` (stop
    after M): documents go to a ``DatasetWriter`` per shard, opened when its first document
    comes. ``add`` returns True once M documents are written. ``abort`` removes the shards
    this run finished too, so a failed run leaves no output."""

    def __init__(self, config: PreprocessConfig, prefix: str, vocab_size: int):
        self.config, self.prefix, self.vocab_size = config, prefix, vocab_size
        self.size, self.left = config.shard_size, config.max_documents
        self.shard, self.in_shard = 0, 0
        self.writer: Optional[DatasetWriter] = None
        self.done: list[DatasetWriter] = []
        self.documents = self.tokens = 0  # what was written (a chunk may hold more)

    def _current(self) -> DatasetWriter:
        if self.writer is None:
            prefix = shard_prefix(self.prefix, self.shard) if self.size else self.prefix
            self.writer = DatasetWriter(self.config, prefix, self.vocab_size)
        return self.writer

    def add(self, result: ChunkResult) -> bool:
        docs = len(next(iter(result.keys.values())).doc_tokens) if result.keys else 0
        if self.left is not None:
            docs = min(docs, self.left)
        first = 0
        while first < docs:
            room = docs - first if not self.size else min(docs - first, self.size - self.in_shard)
            part = slice_result(result, first, first + room)
            self._current().add(part)
            self.documents += room
            self.tokens += sum(len(a.tokens) for a in part.keys.values())
            first += room
            self.in_shard += room
            if self.size and self.in_shard == self.size:
                self._close_shard()
        if self.left is not None:
            self.left -= docs
            return self.left == 0
        return False

    def _close_shard(self) -> None:
        if self.writer is not None:
            self.writer.finalize()
            self.done.append(self.writer)
        self.writer, self.in_shard = None, 0
        self.shard += 1

    def finalize(self) -> None:
        if self.writer is not None or not self.done:
            self._current()  # an empty run (--allow-empty) still writes its one dataset
            self._close_shard()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        for writer in self.done:
            for path in writer.paths.values():
                remove_files(indexed_dataset.data_file_path(path),
                             indexed_dataset.index_file_path(path))


def remove_files(*paths: str) -> None:
    """Remove the files that exist; a failure is reported, not raised, to keep the first error."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            print(f"warning: could not remove {path}: {e.strerror}", file=sys.stderr)


@dataclass
class Stats:
    documents: int = 0
    input_bytes: int = 0
    tokens: int = 0
    blank_lines: int = 0
    skipped: int = 0
    skip_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, other: Stats) -> None:
        self.documents += other.documents
        self.input_bytes += other.input_bytes
        self.tokens += other.tokens
        self.blank_lines += other.blank_lines
        self.skipped += other.skipped
        room = MAX_SKIP_EXAMPLES - len(self.skip_examples)
        self.skip_examples.extend(other.skip_examples[:room])
        self.seconds = max(self.seconds, other.seconds)

    def rates(self) -> str:
        t = max(self.seconds, 1e-9)
        return (f"{self.documents / t:.1f} docs/s, {self.input_bytes / t / 2**20:.2f} MB/s, "
                f"{self.tokens / t:,.0f} tokens/s")


class ProgressLog:
    """Counts results and prints a line each time another --log-interval documents are done;
    with the input's size known (``total_bytes``), the line says how far the run is and when
    it should end (from the bytes read so far)."""

    def __init__(self, interval: int, label: str = "", total_bytes: Optional[int] = None):
        self.interval = interval
        self.label = label
        self.total_bytes = total_bytes
        self.start = time.time()
        self.stats = Stats()

    def update(self, result: ChunkResult, spans: Sequence[Span]) -> None:
        stats = self.stats
        before = stats.documents
        stats.documents += result.documents
        stats.input_bytes += result.input_bytes
        stats.tokens += result.tokens
        stats.blank_lines += result.blank_lines
        stats.skipped += len(result.skipped)
        span = spans[result.span_index]
        for line, reason in result.skipped[: MAX_SKIP_EXAMPLES - len(stats.skip_examples)]:
            stats.skip_examples.append(f"{span.path}:{span.line_number(line)}: {reason}")
        stats.seconds = time.time() - self.start
        if stats.documents // self.interval > before // self.interval:
            # One write per line: partitions share stderr, and print() writes the line and
            # its newline apart, so two partitions' lines could run together.
            sys.stderr.write(f"{self.label}Processed {stats.documents} documents"
                             f"{self._progress()} ({stats.rates()}).\n")
            sys.stderr.flush()

    def _progress(self) -> str:
        """", 42.0% done, ETA 0:01:23" when the input's size is known, else ""."""
        done, total = self.stats.input_bytes, self.total_bytes
        if not total or not done:
            return ""
        return f", {percent_and_eta(done / total, self.stats.seconds)}"

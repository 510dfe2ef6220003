#!/usr/bin/env python
"""Tokenize loose-JSON corpora (one JSON object per line) into Megatron ``.bin``/``.idx`` datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8

Writes ``{prefix}_{key}_document.bin/.idx`` per ``--json-keys`` key (``_sentence`` with
``--split-sentences``). The ``.bin`` is byte-identical to Megatron-DeepSpeed's for the same
input and flags; the ``.idx`` counts the appended EOD in the last sentence's size, as
Megatron-LM does. Documents keep input order whatever ``--workers`` and ``--partitions`` are.

Memory stays flat in corpus size: lines are streamed in chunks and at most a few chunks per
worker are in flight. Outputs are written under temporary names and renamed only when the
whole run succeeds. This file imports neither torch nor transformers (unless a Hugging Face
tokenizer is asked for), so it starts in well under a second.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import indexed_dataset  # noqa: E402
from megatron.tokenizer import (  # noqa: E402
    Tokenizer,
    TokenizerConfig,
    TokenizerConfigError,
    build_tokenizer,
)

CHUNK_BYTES = 1 << 20  # a work item holds at most this much input (and --chunk-size lines)
PUNKT_SAMPLE_CHARS = 1_000_000  # text used to train Punkt when nltk's data is not installed
SPLIT_PIECE_CHARS = 1_000_000  # Megatron-DeepSpeed splits sentences in pieces of this size
MAX_SKIP_EXAMPLES = 10


class InputError(Exception):
    """Bad input or flags; the message names the file and line, or the flag."""


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreprocessConfig:
    """Validated flags of one preprocessing run."""

    inputs: tuple[str, ...]  # files, in the order their documents are written
    output_prefix: str
    tokenizer: TokenizerConfig
    json_keys: tuple[str, ...] = ("text",)
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    append_eod: bool = False
    workers: int = 1
    partitions: int = 1
    chunk_size: int = 512
    log_interval: int = 1000
    skip_bad_lines: bool = False

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_name(self, prefix: str, key: str) -> str:
        """Path without extension of one key's dataset under ``prefix``."""
        return f"{prefix}_{key}_{self.level}"


def resolve_inputs(patterns: Sequence[str]) -> tuple[str, ...]:
    """Expand files and globs in order; raises naming --input when a path or glob is empty."""
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise InputError(f"--input {pattern!r} matched no files")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise InputError(f"--input {pattern!r} is a directory; give files or a glob")
        elif not os.path.isfile(pattern):
            raise InputError(f"--input {pattern!r} does not exist")
        else:
            files.append(pattern)
    return tuple(files)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="JSON-lines file(s) or glob(s); one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract; each gets its own .bin/.idx")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences with nltk Punkt")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep the newlines between sentences when splitting")
    group.add_argument("--lang", default="english", help="Punkt language for --split-sentences")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) malformed lines instead of stopping with an error")

    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="GPT2BPETokenizer, PretrainedFromHF (alias HFTokenizer, "
                            "HuggingFaceTokenizer) or NullTokenizer")
    group.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-name-or-path", default=None,
                       help="local directory of a Hugging Face tokenizer (loaded offline)")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocab size")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each non-empty document")

    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="output path without the _{key}_{level}.bin/.idx suffix")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="only mmap (Megatron's default format) is written")

    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many contiguous parts, process them "
                            "concurrently (workers are shared out) and merge the results")
    group.add_argument("--chunk-size", type=int, default=512,
                       help=f"lines per work item (at most {CHUNK_BYTES >> 20} MiB of input)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents")
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """Validate flags and inputs before any work starts."""
    for name in ("workers", "partitions", "chunk_size", "log_interval"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise InputError(f"--json-keys has a repeated key: {args.json_keys}")
    tokenizer = TokenizerConfig(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_name_or_path=args.tokenizer_name_or_path,
        vocab_size=args.vocab_size,
    )
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise InputError(f"--output-prefix: directory {out_dir!r} does not exist")
    return PreprocessConfig(
        inputs=resolve_inputs(args.input),
        output_prefix=args.output_prefix,
        tokenizer=tokenizer,
        json_keys=tuple(args.json_keys),
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
        append_eod=args.append_eod,
        workers=args.workers,
        partitions=args.partitions,
        chunk_size=args.chunk_size,
        log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines,
    )


# ----------------------------------------------------------------------------------------------
# Reading: spans of input files, cut into chunks of whole lines
# ----------------------------------------------------------------------------------------------


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


def iter_chunks(spans: Sequence[Span], chunk_lines: int) -> Iterator[Chunk]:
    """Whole lines of each span in order, at most ``chunk_lines`` lines / ~1 MiB per chunk."""
    for span_index, span in enumerate(spans):
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


# ----------------------------------------------------------------------------------------------
# Sentence splitting (nltk Punkt)
# ----------------------------------------------------------------------------------------------


def _keep_newlines_lang_vars():
    from nltk.tokenize import punkt

    class KeepNewlinesLanguageVars(punkt.PunktLanguageVars):
        # Punkt normally requires whitespace before the next sentence and drops it; allowing
        # none (\s* inside the match) leaves newlines attached to the sentence they end.
        _period_context_fmt = r"""
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # whitespace kept with the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next token
            ))"""

    return KeepNewlinesLanguageVars()


def build_splitter(config: PreprocessConfig, log=print):
    """A Punkt sentence splitter: nltk's data for --lang if installed, else trained here.

    Trained once, in the main process, on the first ~1M characters of the input, so every
    worker and partition splits with the same model.
    """
    from nltk.tokenize import punkt

    params = _installed_punkt_params(config.lang)
    if params is None:
        sample = _punkt_training_sample(config)
        trainer = punkt.PunktTrainer()
        trainer.train(sample, finalize=True)
        params = trainer.get_params()
        log(f"nltk punkt data for {config.lang!r} is not installed: trained a Punkt model on "
            f"the first {len(sample):,} characters of the input instead")
    lang_vars = _keep_newlines_lang_vars() if config.keep_newlines else punkt.PunktLanguageVars()
    return punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)


def _installed_punkt_params(lang: str):
    from nltk.tokenize import punkt

    try:
        return punkt.PunktTokenizer(lang)._params
    except (LookupError, OSError, AttributeError, ValueError):
        pass
    try:
        import nltk

        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")._params
    except (LookupError, OSError, ValueError):
        return None


def _punkt_training_sample(config: PreprocessConfig) -> str:
    texts: list[str] = []
    size = 0
    for chunk in iter_chunks([Span(p) for p in config.inputs], 1024):
        for line in chunk.lines:
            try:
                data = json.loads(line)
            except ValueError:
                continue
            for key in config.json_keys:
                value = data.get(key) if isinstance(data, dict) else None
                values = value if isinstance(value, list) else [value]
                for text in values:
                    if isinstance(text, str):
                        texts.append(text)
                        size += len(text)
            if size >= PUNKT_SAMPLE_CHARS:
                return "\n\n".join(texts)[:PUNKT_SAMPLE_CHARS]
    return "\n\n".join(texts)


# ----------------------------------------------------------------------------------------------
# Encoding (runs in the worker processes)
# ----------------------------------------------------------------------------------------------


class BadLine(Exception):
    """One input line cannot be turned into a document."""


@dataclass
class KeyArrays:
    """One chunk's output for one JSON key."""

    tokens: np.ndarray  # [chunk tokens], the dataset dtype
    sizes: np.ndarray  # [chunk sentences], int64, EOD counted in a document's last sentence
    doc_sentences: np.ndarray  # [chunk documents], int64, sentences per document
    doc_tokens: np.ndarray  # [chunk documents], int64, tokens per document


@dataclass
class ChunkResult:
    span_index: int
    first_line: int
    documents: int = 0
    input_bytes: int = 0
    tokens: int = 0
    blank_lines: int = 0
    keys: dict[str, KeyArrays] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line in span, reason)
    error: Optional[tuple[int, str]] = None


class ChunkEncoder:
    """Turns chunks of JSON lines into token arrays, following Megatron-DeepSpeed's Encoder:
    each sentence is tokenized, empty sentences are dropped, and EOD is appended to a document
    that has tokens. A JSON list is a document already split into sentences."""

    def __init__(self, config: PreprocessConfig, tokenizer: Tokenizer, splitter: Any, dtype):
        self.keys = config.json_keys
        self.append_eod = config.append_eod
        self.skip_bad_lines = config.skip_bad_lines
        self.tokenizer = tokenizer
        self.splitter = splitter
        self.dtype = np.dtype(dtype)
        self.eod = np.array([tokenizer.eod], dtype=np.uint32)

    def encode_chunk(self, chunk: Chunk) -> ChunkResult:
        result = ChunkResult(chunk.span_index, chunk.first_line)
        parts = {key: ([], [], [], []) for key in self.keys}  # tokens, sizes, sentences, totals
        for i, line in enumerate(chunk.lines):
            result.input_bytes += len(line)
            if not line.strip():
                result.blank_lines += 1
                continue
            try:
                docs = self._encode_line(line)
            except BadLine as e:
                if not self.skip_bad_lines:
                    result.error = (chunk.first_line + i, str(e))
                    return result
                result.skipped.append((chunk.first_line + i, str(e)))
                continue
            result.documents += 1
            for key, sentences in zip(self.keys, docs):
                tokens, sizes, n_sentences, totals = parts[key]
                lengths = [len(s) for s in sentences]
                tokens.extend(sentences)
                sizes.extend(lengths)
                n_sentences.append(len(lengths))
                totals.append(sum(lengths))
        for key, (tokens, sizes, n_sentences, totals) in parts.items():
            result.keys[key] = self._to_arrays(tokens, sizes, n_sentences, totals)
            result.tokens += len(result.keys[key].tokens)
        return result

    def _encode_line(self, line: bytes) -> list[list[np.ndarray]]:
        """Per key, the document's non-empty sentences as token arrays (EOD already added)."""
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadLine(f"invalid UTF-8 at byte {e.start} of the line ({e.reason})") from None
        if text.startswith("\ufeff"):  # a byte-order mark some editors put at a file's start
            text = text[1:]
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadLine(f"malformed JSON: {e.msg} at column {e.colno}") from None
        except (ValueError, RecursionError) as e:  # e.g. a 5000-digit number, deep nesting
            raise BadLine(f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise BadLine(f"expected a JSON object, got {_json_type(data)}")
        return [self._encode_document(data, key) for key in self.keys]

    def _encode_document(self, data: dict, key: str) -> list[np.ndarray]:
        if key not in data:
            raise BadLine(f"missing key {key!r} (from --json-keys)")
        sentences = self._sentences(data[key], key)
        encoded = []
        for sentence in sentences:
            try:
                ids = self.tokenizer.tokenize_to_numpy(sentence)
            except (ValueError, TypeError) as e:
                raise BadLine(f"key {key!r}: {e}") from None
            if len(ids):
                encoded.append(ids)
        if encoded and self.append_eod:
            encoded[-1] = np.concatenate([encoded[-1], self.eod])
        return encoded

    def _sentences(self, value: Any, key: str) -> list[str]:
        if isinstance(value, list):
            for item in value:
                if not isinstance(item, str):
                    raise BadLine(f"key {key!r} is an array holding {_json_type(item)}, "
                                  "expected strings (pre-split sentences)")
            return value
        if not isinstance(value, str):
            raise BadLine(f"key {key!r} holds {_json_type(value)}, expected a string or an "
                          "array of strings")
        if self.splitter is None:
            return [value]
        return [
            sentence
            for start in range(0, len(value), SPLIT_PIECE_CHARS)
            for sentence in self.splitter.tokenize(value[start : start + SPLIT_PIECE_CHARS])
        ]

    def _to_arrays(self, tokens, sizes, n_sentences, totals) -> KeyArrays:
        flat = np.concatenate(tokens) if tokens else np.empty(0, dtype=np.uint32)
        if flat.size and np.issubdtype(self.dtype, np.integer):
            top = int(flat.max())
            if top > np.iinfo(self.dtype).max:
                raise InputError(f"token id {top} does not fit the dataset dtype {self.dtype} "
                                 f"chosen from the tokenizer's vocab size")
        return KeyArrays(
            tokens=flat.astype(self.dtype, copy=False),
            sizes=np.asarray(sizes, dtype=np.int64),
            doc_sentences=np.asarray(n_sentences, dtype=np.int64),
            doc_tokens=np.asarray(totals, dtype=np.int64),
        )


def _json_type(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


_WORKER_ENCODER: Optional[ChunkEncoder] = None


def _init_worker(encoder: ChunkEncoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(chunk: Chunk) -> ChunkResult:
    return _WORKER_ENCODER.encode_chunk(chunk)


def _mp_context():
    # fork hands the built tokenizer and splitter to workers without pickling or rebuilding.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def encode_stream(encoder: ChunkEncoder, chunks: Iterator[Chunk], workers: int):
    """Encoded chunks in input order; at most ~2 chunks per worker are in flight."""
    if workers == 1:
        for chunk in chunks:
            yield encoder.encode_chunk(chunk)
        return
    pool = _mp_context().Pool(workers, initializer=_init_worker, initargs=(encoder,))
    try:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


# ----------------------------------------------------------------------------------------------
# Writing and progress (main process)
# ----------------------------------------------------------------------------------------------


class DatasetWriter:
    """One builder per JSON key; files stay under temporary names until ``finalize``."""

    def __init__(self, config: PreprocessConfig, prefix: str, vocab_size: int):
        self.paths = {key: config.output_name(prefix, key) for key in config.json_keys}
        self.builders = {}
        try:
            for key, path in self.paths.items():
                self.builders[key] = indexed_dataset.make_builder(
                    indexed_dataset.data_file_path(path), impl="mmap", vocab_size=vocab_size
                )
        except BaseException:
            self.abort()
            raise

    def add(self, result: ChunkResult) -> None:
        for key, arrays in result.keys.items():
            builder = self.builders[key]
            token_ends = np.cumsum(arrays.doc_tokens).tolist()
            sentence_ends = np.cumsum(arrays.doc_sentences).tolist()
            t0 = s0 = 0
            for t1, s1 in zip(token_ends, sentence_ends):
                builder.add_doc(arrays.tokens[t0:t1], arrays.sizes[s0:s1])
                t0, s0 = t1, s1

    def merge(self, prefix: str, config: PreprocessConfig) -> None:
        for key, builder in self.builders.items():
            builder.merge_file_(config.output_name(prefix, key))

    def finalize(self) -> None:
        for key, builder in self.builders.items():
            builder.finalize(indexed_dataset.index_file_path(self.paths[key]))

    def abort(self) -> None:
        for key, builder in self.builders.items():
            builder.abort()
            remove_files(indexed_dataset.index_file_path(self.paths[key]) + ".tmp")


def remove_files(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


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
    """Counts results and prints a line each time another --log-interval documents are done."""

    def __init__(self, interval: int, label: str = ""):
        self.interval = interval
        self.label = label
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
            print(f"{self.label}Processed {stats.documents} documents ({stats.rates()}).",
                  file=sys.stderr, flush=True)


def run_stream(config: PreprocessConfig, encoder: ChunkEncoder, spans: Sequence[Span],
               prefix: str, workers: int, vocab_size: int, label: str = "") -> Stats:
    """Encode ``spans`` with ``workers`` processes into the datasets under ``prefix``."""
    writer = DatasetWriter(config, prefix, vocab_size)
    progress = ProgressLog(config.log_interval, label)
    stream = encode_stream(encoder, iter_chunks(spans, config.chunk_size), workers)
    try:
        for result in stream:
            if result.error is not None:
                span = spans[result.span_index]
                line, reason = result.error
                raise InputError(f"{span.path}:{span.line_number(line)}: {reason} "
                                 "(pass --skip-bad-lines to skip such lines)")
            writer.add(result)
            progress.update(result, spans)
        writer.finalize()
    except BaseException:
        stream.close()
        writer.abort()
        raise
    return progress.stats


# ----------------------------------------------------------------------------------------------
# Partitions: contiguous pieces processed concurrently, then merged in order
# ----------------------------------------------------------------------------------------------


def _partition_files(config: PreprocessConfig, prefix: str) -> list[str]:
    names = []
    for key in config.json_keys:
        base = config.output_name(prefix, key)
        for path in (indexed_dataset.data_file_path(base), indexed_dataset.index_file_path(base)):
            names += [path, path + ".tmp"]
    return names


def _partition_main(config, encoder, spans, prefix, workers, vocab_size, label, conn) -> None:
    try:
        stats = run_stream(config, encoder, spans, prefix, workers, vocab_size, label)
        conn.send(("ok", stats))
    except InputError as e:
        conn.send(("error", str(e)))
    except BaseException as e:  # report it rather than die silently in a child process
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_partitions(config: PreprocessConfig, encoder: ChunkEncoder,
                   pieces: list[list[Span]], vocab_size: int) -> Stats:
    """Process each piece in its own process (sharing out --workers), then merge in order."""
    from multiprocessing.connection import wait

    ctx = _mp_context()
    workers = max(1, config.workers // len(pieces))
    prefixes = [f"{config.output_prefix}.partition{k}.tmp" for k in range(len(pieces))]
    children = []
    try:
        for k, spans in enumerate(pieces):
            recv, send = ctx.Pipe(duplex=False)
            label = f"[partition {k + 1}/{len(pieces)}] "
            proc = ctx.Process(target=_partition_main, args=(
                config, encoder, spans, prefixes[k], workers, vocab_size, label, send))
            proc.start()
            send.close()
            children.append((proc, recv))
        stats = Stats()
        pending = {recv: (k, proc) for k, (proc, recv) in enumerate(children)}
        while pending:
            # Any partition may fail first; stop the others as soon as one does.
            for recv in wait(list(pending)):
                k, proc = pending.pop(recv)
                try:
                    status, payload = recv.recv()
                except EOFError:
                    proc.join()
                    raise InputError(
                        f"partition {k + 1} died (exit code {proc.exitcode})"
                    ) from None
                if status != "ok":
                    raise InputError(payload)
                stats.add(payload)
        merge_start = time.time()
        writer = DatasetWriter(config, config.output_prefix, vocab_size)
        try:
            for prefix in prefixes:
                writer.merge(prefix, config)
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
        print(f"Merged {len(pieces)} partitions in {time.time() - merge_start:.2f} s")
        return stats
    finally:
        for proc, recv in children:
            if proc.is_alive():
                proc.terminate()
            proc.join()
            recv.close()
        for prefix in prefixes:
            remove_files(*_partition_files(config, prefix))


# ----------------------------------------------------------------------------------------------
# Entry
# ----------------------------------------------------------------------------------------------


def run(config: PreprocessConfig, start_time: Optional[float] = None) -> Stats:
    """Tokenize ``config.inputs`` into the datasets under ``config.output_prefix``."""
    start_time = time.time() if start_time is None else start_time
    tokenizer = build_tokenizer(config.tokenizer)
    backend = getattr(tokenizer, "backend", None)
    print(f"Tokenizer: {config.tokenizer.tokenizer_type}"
          + (f" ({backend} backend)" if backend else "")
          + f", vocab size {tokenizer.vocab_size}, eod {tokenizer.eod}")
    shown = ", ".join(config.inputs[:5]) + (" ..." if len(config.inputs) > 5 else "")
    print(f"Opening {len(config.inputs)} input file(s): {shown}")
    splitter = build_splitter(config) if config.split_sentences else None
    vocab_size = tokenizer.vocab_size
    dtype = indexed_dataset.best_fitting_dtype(vocab_size)
    encoder = ChunkEncoder(config, tokenizer, splitter, dtype)
    pieces = [[Span(p) for p in config.inputs]]
    if config.partitions > 1:
        pieces = plan_partitions(config.inputs, config.partitions) or pieces
    for key in config.json_keys:
        print(f"Output: {config.output_name(config.output_prefix, key)}.bin/.idx ({dtype})")
    print(f"Time to startup: {time.time() - start_time:.2f} s")
    if len(pieces) == 1:
        stats = run_stream(config, encoder, pieces[0], config.output_prefix, config.workers,
                           vocab_size)
    else:
        stats = run_partitions(config, encoder, pieces, vocab_size)
    _print_summary(stats, time.time() - start_time)
    return stats


def _print_summary(stats: Stats, wall: float) -> None:
    print(f"Done: {stats.documents} documents, {stats.tokens:,} tokens, "
          f"{stats.input_bytes / 2**20:.2f} MB of input.")
    print(f"In-loop: {stats.seconds:.2f} s ({stats.rates()}).")
    whole = Stats(stats.documents, stats.input_bytes, stats.tokens, seconds=wall)
    print(f"Whole run: {wall:.2f} s ({whole.rates()}).")
    if stats.blank_lines:
        print(f"Ignored {stats.blank_lines} blank line(s).")
    if stats.skipped:
        print(f"Skipped {stats.skipped} bad line(s) (--skip-bad-lines), for example:")
        for example in stats.skip_examples:
            print(f"  {example}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    start_time = time.time()
    args = build_parser().parse_args(argv)
    try:
        run(config_from_args(args), start_time)
    except (InputError, TokenizerConfigError, indexed_dataset.IndexedDatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

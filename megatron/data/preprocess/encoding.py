"""Encoding: JSON lines to token arrays (runs in the worker processes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from megatron.data.preprocess.config import InputError, PreprocessConfig
from megatron.data.preprocess.reading import Chunk
from megatron.tokenizer import Tokenizer

SPLIT_PIECE_CHARS = 1_000_000  # Megatron-DeepSpeed splits sentences in pieces of this size


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

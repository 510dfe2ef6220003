"""Validated flags of one preprocessing run, and the errors the pipeline reports."""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from megatron.tokenizer import TokenizerConfig


class PreprocessError(Exception):
    """Anything that stops a run; the message names the file, flag or process."""


class InputError(PreprocessError):
    """Bad input or flags; the message names the file and line, or the flag."""


class OutputError(PreprocessError):
    """An output file could not be written (full disk, no permission); names the path."""


class WorkerDied(PreprocessError):
    """A worker or partition process ended without a result; names its pid and signal."""


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
    allow_empty: bool = False
    dataset_impl: str = "mmap"  # or the legacy "lazy"/"cached" (TNTIDX) format
    hf_split: Optional[str] = None  # the split of a saved DatasetDict
    shard_size: Optional[int] = None  # documents per output shard
    max_documents: Optional[int] = None  # stop after this many documents

    @property
    def hf_inputs(self) -> bool:
        return any(is_hf_input(p) for p in self.inputs)

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_name(self, prefix: str, key: str) -> str:
        """Path without extension of one key's dataset under ``prefix``."""
        return f"{prefix}_{key}_{self.level}"


# What makes an input a local Hugging Face dataset (read by hf_reading).
HF_FILE_SUFFIXES = (".parquet", ".arrow")
_FOLDER_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


def is_hf_input(path: str) -> bool:
    """A Parquet/Arrow file, or a folder written by ``save_to_disk``."""
    if os.path.isdir(path):
        return any(os.path.isfile(os.path.join(path, m)) for m in _FOLDER_MARKERS)
    return path.endswith(HF_FILE_SUFFIXES)


def resolve_inputs(patterns: Sequence[str]) -> tuple[str, ...]:
    """Expand files and globs in order; raises naming --input when a path or glob is empty."""
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern) and is_hf_input(pattern):
            files.append(pattern)  # a folder written by datasets' save_to_disk
        elif glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise InputError(f"--input {pattern!r} matched no files")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise InputError(f"--input {pattern!r} is a directory but not a Hugging Face "
                             "dataset saved with save_to_disk; give files, a glob or such a "
                             "folder")
        elif not os.path.isfile(pattern):
            raise InputError(f"--input {pattern!r} does not exist")
        else:
            files.append(pattern)
    return tuple(files)


def check_output_dir(output_prefix: str) -> None:
    """Raise naming --output-prefix unless its folder exists and a file can be created there."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise InputError(f"--output-prefix: directory {out_dir!r} does not exist")
    # Creating a file is the only reliable test: os.access says yes to root on a read-only
    # mount or a pseudo file system.
    try:
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise InputError(f"--output-prefix: directory {out_dir!r} is not writable "
                         f"({e.strerror})") from None


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """Validate flags and inputs before any work starts."""
    for name in ("workers", "partitions", "chunk_size", "log_interval"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("shard_size", "max_documents"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    if args.partitions > 1 and (getattr(args, "shard_size", None)
                                or getattr(args, "max_documents", None)):
        raise InputError("--shard-size and --max-documents count documents in one stream; "
                         "use them with --partitions 1 (--workers still applies)")
    if getattr(args, "hf_text_column", None):
        args.json_keys = [args.hf_text_column]
    if len(set(args.json_keys)) != len(args.json_keys):
        raise InputError(f"--json-keys has a repeated key: {args.json_keys}")
    tokenizer = TokenizerConfig(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_name_or_path=args.tokenizer_name_or_path,
        vocab_size=args.vocab_size,
    )
    check_output_dir(args.output_prefix)
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
        allow_empty=getattr(args, "allow_empty", False),
        dataset_impl=getattr(args, "dataset_impl", "mmap"),
        hf_split=getattr(args, "hf_split", None),
        shard_size=getattr(args, "shard_size", None),
        max_documents=getattr(args, "max_documents", None),
    )

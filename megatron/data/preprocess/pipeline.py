"""The run: encode spans into datasets, in one stream or in partitions merged in order."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any, Optional

from megatron.data import indexed_dataset
from megatron.data.preprocess.config import (
    InputError,
    PreprocessConfig,
    PreprocessError,
    config_from_args,
    is_hf_input,
)
from megatron.data.preprocess.encoding import ChunkEncoder
from megatron.data.preprocess.hf_reading import (
    HFSpan,
    check_hf_input,
    iter_input_chunks,
    plan_hf_partitions,
)
from megatron.data.preprocess.reading import Span, input_size, plan_partitions
from megatron.data.preprocess.sentences import build_splitter
from megatron.data.preprocess.workers import (
    encode_stream,
    mp_context,
    prepare_child,
    receive,
    start_child,
    stop,
)
from megatron.data.preprocess.writing import DatasetWriter, ProgressLog, ShardedWriter, Stats
from megatron.tokenizer import TokenizerConfigError, build_tokenizer


class Terminated(SystemExit):
    """SIGTERM reached the parent; raised so that every ``finally`` removes partial files."""


def check_documents(config: PreprocessConfig, stats: Stats) -> None:
    """A run that found no documents is almost always a wrong file; say so unless allowed."""
    if stats.documents or config.allow_empty:
        return
    blank = f" ({stats.blank_lines} blank line(s))" if stats.blank_lines else ""
    skipped = f" ({stats.skipped} bad line(s) skipped)" if stats.skipped else ""
    raise InputError(f"no documents in --input {', '.join(config.inputs)}{blank}{skipped}; "
                     "pass --allow-empty to write an empty dataset")


def run_stream(config: PreprocessConfig, encoder: ChunkEncoder, spans: Sequence[Span],
               prefix: str, workers: int, vocab_size: int, label: str = "",
               whole_run: bool = True) -> Stats:
    """Encode ``spans`` with ``workers`` processes into the datasets under ``prefix``.

    ``whole_run`` is False for one partition, which may legitimately hold no documents.
    """
    limited = config.shard_size is not None or config.max_documents is not None
    writer = (ShardedWriter if limited else DatasetWriter)(config, prefix, vocab_size)
    progress = ProgressLog(config.log_interval, label, input_size(spans))
    chunks = iter_input_chunks(spans, config.chunk_size, config.json_keys)
    stream = encode_stream(encoder, chunks, workers)
    try:
        for result in stream:
            if result.error is not None:
                span = spans[result.span_index]
                line, reason = result.error
                raise InputError(f"{span.path}:{span.line_number(line)}: {reason} "
                                 "(pass --skip-bad-lines to skip such lines)")
            enough = writer.add(result)
            progress.update(result, spans)
            if enough:  # --max-documents reached: read no further
                stream.close()
                break
        if limited:  # the statistics count what was written, not the last chunk's rest
            progress.stats.documents, progress.stats.tokens = writer.documents, writer.tokens
        if whole_run:
            check_documents(config, progress.stats)
        writer.finalize()
    except BaseException:
        stream.close()
        writer.abort()
        raise
    return progress.stats


# ----------------------------------------------------------------------------------------------
# Partitions: contiguous pieces processed concurrently, then merged in order
# ----------------------------------------------------------------------------------------------


def _partition_main(config, encoder, spans, prefix, workers, vocab_size, label, conn,
                    parent: int) -> None:
    prepare_child(parent)
    try:
        stats = run_stream(config, encoder, spans, prefix, workers, vocab_size, label,
                           whole_run=False)
        conn.send(("ok", stats))
    except PreprocessError as e:
        conn.send(("error", str(e)))
    except BaseException as e:  # report it rather than die silently in a child process
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _partition_dir(config: PreprocessConfig) -> str:
    # One hidden folder per run beside the output, named as temporary, so that the pieces
    # never look like finished datasets and one rmtree removes them all.
    out_dir = os.path.dirname(os.path.abspath(config.output_prefix))
    base = os.path.basename(config.output_prefix)
    return tempfile.mkdtemp(prefix=f".{base}.partitions-", suffix=".tmp", dir=out_dir)


def _wait_for_partitions(children: list[tuple[Any, Any]]) -> Stats:
    stats = Stats()
    pending = dict(enumerate(children))
    while pending:
        # Any partition may fail or die first; stop the others as soon as one does.
        handles = {h: k for k, (proc, recv) in pending.items() for h in (recv, proc.sentinel)}
        ready = {handles[h] for h in wait(list(handles))}
        for k in sorted(ready):
            proc, recv = pending.pop(k)
            status, payload = receive(recv, proc, f"partition {k + 1} process")
            if status != "ok":
                raise InputError(payload)
            stats.add(payload)
    return stats


def run_partitions(config: PreprocessConfig, encoder: ChunkEncoder,
                   pieces: list[list[Span]], vocab_size: int) -> Stats:
    """Process each piece in its own process (sharing out --workers), then merge in order."""
    ctx = mp_context()
    workers = max(1, config.workers // len(pieces))
    tmp_dir = _partition_dir(config)
    prefixes = [os.path.join(tmp_dir, f"partition{k}") for k in range(len(pieces))]
    children = []
    try:
        for k, spans in enumerate(pieces):
            recv, send = ctx.Pipe(duplex=False)
            label = f"[partition {k + 1}/{len(pieces)}] "
            proc = ctx.Process(target=_partition_main, args=(
                config, encoder, spans, prefixes[k], workers, vocab_size, label, send,
                os.getpid()))
            start_child(proc)
            send.close()
            children.append((proc, recv))
        stats = _wait_for_partitions(children)
        check_documents(config, stats)
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
            stop(proc)
            recv.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)


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
    if config.dataset_impl != "mmap":  # the legacy builder writes int32, as Megatron's did
        dtype = indexed_dataset.make_builder(os.devnull, config.dataset_impl, atomic=False).dtype
    encoder = ChunkEncoder(config, tokenizer, splitter, dtype)
    pieces = [input_spans(config)]
    if config.partitions > 1:
        pieces = plan_input_partitions(config, pieces[0]) or pieces
    for key in config.json_keys:
        shards = "_NNNNN" if config.shard_size else ""
        print(f"Output: {config.output_name(config.output_prefix + shards, key)}.bin/.idx "
              f"({dtype})")
    print(f"Time to startup: {time.time() - start_time:.2f} s")
    if len(pieces) == 1:
        stats = run_stream(config, encoder, pieces[0], config.output_prefix, config.workers,
                           vocab_size)
    else:
        stats = run_partitions(config, encoder, pieces, vocab_size)
    _print_summary(stats, time.time() - start_time)
    return stats


def input_spans(config: PreprocessConfig) -> list[Span]:
    """One span per input: a JSON-lines file, or every row of a local HF dataset (opened
    here, so a missing column or split is reported before any work)."""
    spans: list[Span] = []
    for path in config.inputs:
        if is_hf_input(path):
            rows = check_hf_input(path, config.hf_split, config.json_keys)
            print(f"{path}: {rows} rows (Hugging Face dataset, columns {config.json_keys})")
            spans.append(HFSpan(path, 0, rows, 0, config.hf_split))
        else:
            spans.append(Span(path))
    return spans


def plan_input_partitions(config: PreprocessConfig, spans: list[Span]) -> list[list[Span]]:
    """--partitions: by bytes for JSON-lines files, by rows for HF datasets (not mixed)."""
    hf = [isinstance(s, HFSpan) for s in spans]
    if all(hf):
        return plan_hf_partitions(spans, [s.end for s in spans], config.partitions)
    if any(hf):
        raise InputError("--partitions cannot mix Hugging Face datasets and JSON-lines files "
                         "in one run; use --partitions 1")
    return plan_partitions(config.inputs, config.partitions)


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


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def run_from_args(args: argparse.Namespace, start_time: Optional[float] = None) -> int:
    """Validate, run, and turn every expected failure into a message and an exit status."""
    start_time = time.time() if start_time is None else start_time
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        run(config_from_args(args), start_time)
    except (PreprocessError, TokenizerConfigError, indexed_dataset.IndexedDatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output was written", file=sys.stderr)
        return 130
    except Terminated as e:
        print("terminated (SIGTERM); no output was written", file=sys.stderr)
        return e.code
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0

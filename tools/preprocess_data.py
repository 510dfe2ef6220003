#!/usr/bin/env python
"""Tokenize loose-JSON corpora or local HF datasets into Megatron ``.bin``/``.idx`` datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8

Writes ``{prefix}_{key}_document.bin/.idx`` per ``--json-keys`` key (``_sentence`` with
``--split-sentences``). The ``.bin`` is byte-identical to Megatron-DeepSpeed's for the same
input and flags; the ``.idx`` counts the appended EOD in the last sentence's size, as
Megatron-LM does. Documents keep input order whatever ``--workers`` and ``--partitions`` are.

The pipeline lives in ``megatron/data/preprocess/``; this file holds only the flags. It imports
neither torch nor transformers (unless a Hugging Face tokenizer is asked for), so it starts in
well under a second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.preprocess import CHUNK_BYTES, run_from_args  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="JSON-lines file(s) or glob(s), one JSON object per line; or local "
                            "Hugging Face datasets: a save_to_disk folder, .parquet or .arrow "
                            "files (read offline)")
    group.add_argument("--hf-split", default=None,
                       help="split of a saved DatasetDict (default: train)")
    group.add_argument("--hf-text-column", default=None,
                       help="column of a Hugging Face dataset to tokenize (sets --json-keys)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract; each gets its own .bin/.idx")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences with nltk Punkt")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep the newlines between sentences when splitting")
    group.add_argument("--lang", default="english", help="Punkt language for --split-sentences")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) malformed lines instead of stopping with an error")
    group.add_argument("--allow-empty", action="store_true",
                       help="write an empty dataset when the input holds no documents "
                            "instead of stopping with an error")

    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="GPT2BPETokenizer, PretrainedFromHF (alias HFTokenizer, "
                            "HuggingFaceTokenizer), Llama2Tokenizer, GPTSentencePieceTokenizer, "
                            "Llama3Tokenizer or NullTokenizer")
    group.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-name-or-path", "--tokenizer-model",
                       dest="tokenizer_name_or_path", default=None,
                       help="local directory of a Hugging Face tokenizer (loaded offline), or "
                            "the tokenizer.model file of the Llama tokenizer types")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocab size")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each non-empty document")

    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="output path without the _{key}_{level}.bin/.idx suffix")
    group.add_argument("--shard-size", type=int, default=None,
                       help="write a new dataset every this many documents: "
                            "{prefix}_00000_{key}_document.bin/.idx, {prefix}_00001_...")
    group.add_argument("--max-documents", type=int, default=None,
                       help="stop after this many documents")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap", "lazy", "cached"],
                       help="mmap (Megatron's format, the default) or the legacy TNTIDX pair "
                            "that --data-impl lazy/cached read (int32 tokens)")

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


def main(argv: Optional[Sequence[str]] = None) -> int:
    start_time = time.time()
    return run_from_args(build_parser().parse_args(argv), start_time)


if __name__ == "__main__":
    sys.exit(main())

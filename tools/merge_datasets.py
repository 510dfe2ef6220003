#!/usr/bin/env python
"""Merge several Megatron ``.bin``/``.idx`` datasets into one, keeping documents and order.

    python tools/merge_datasets.py --input data/shards/ --output-prefix data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab
    python tools/merge_preprocessed_data.py --datasets a_text_document b_text_document \
        --output-prefix ab                             (Megatron-DeepSpeed's spelling)

A directory input takes every ``*.idx`` with a matching ``.bin`` in it, sorted by name. Inputs
may be mmap pairs or legacy ``lazy``/``cached`` (TNTIDX) pairs, told apart by the .idx's magic;
the output is always mmap. All inputs must have the same token dtype; the output is written
under temporary names and renamed when complete.

Pairs of Megatron-DeepSpeed's ``preprocess_data.py --append-eod`` (sizes that leave out each
document's EOD) merge as Megatron-DeepSpeed's own merge does: whole ``.bin`` files, sizes as
they are, so the output is such a pair of all the documents (read as Megatron-DeepSpeed reads
it, byte for byte its merge's output). Mixed with pairs that count their EODs they cannot make
one consistent pair: refused, naming the pairs and ``--fix-eod-index``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import indexed_dataset  # noqa: E402
from megatron.data import legacy_indexed_dataset as legacy  # noqa: E402
from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
)
from megatron.data.preprocess.config import InputError, check_output_dir  # noqa: E402


class MergeError(Exception):
    """The inputs cannot be merged; the message names the files."""


def _strip_suffix(path: str) -> str:
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def resolve_prefixes(inputs: Sequence[str], output_prefix: str) -> list[str]:
    """Dataset prefixes from directories (sorted) and prefixes, in order; checks both files.

    A directory's pair named like the output (an earlier merge) is left out.
    """
    out = os.path.abspath(output_prefix)
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, name[:-4])
                for name in os.listdir(item)
                if name.endswith(".idx") and os.path.isfile(os.path.join(item, name[:-4] + ".bin"))
            )
            found = [p for p in found if os.path.abspath(p) != out]
            if not found:
                raise MergeError(f"--input directory {item!r} holds no .bin/.idx pairs")
            prefixes.extend(found)
            continue
        prefix = _strip_suffix(item)
        if os.path.abspath(prefix) == out:
            raise MergeError(f"--output-prefix {output_prefix!r} is also an --input")
        for path in (index_file_path(prefix), data_file_path(prefix)):
            if not os.path.isfile(path):
                raise MergeError(f"--input {item!r}: {path} does not exist")
        prefixes.append(prefix)
    return prefixes


def check_dtypes(prefixes: Sequence[str]) -> None:
    """Raise MergeError naming every file when the inputs do not share one token dtype."""
    dtypes = {}
    for prefix in prefixes:
        dataset = indexed_dataset.make_dataset(prefix, "infer")  # mmap or legacy
        dtypes[prefix] = dataset.dtype
        dataset.close()
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{index_file_path(p)} ({d})" for p, d in dtypes.items())
        raise MergeError(f"cannot merge datasets of different token dtypes: {listing}")


def uncounted_eod_inputs(prefixes: Sequence[str]) -> list[str]:
    """The inputs that are Megatron-DeepSpeed --append-eod pairs; MergeError when they are
    mixed with pairs that count their EODs (no index can describe both)."""
    quirky = []
    for prefix in prefixes:
        if legacy.is_legacy_index(index_file_path(prefix)):
            continue
        dataset = MMapIndexedDataset(prefix, verify=False)
        try:
            quirk = indexed_dataset.find_uncounted_eod(
                dataset.index, data_file_path(prefix), os.path.getsize(data_file_path(prefix)))
        finally:
            dataset.close()
        if quirk is not None:
            quirky.append(prefix)
    if quirky and len(quirky) != len(prefixes):
        fixes = "; ".join(f"python tools/inspect_dataset.py --fix-eod-index {p}" for p in quirky)
        raise MergeError(
            f"{', '.join(index_file_path(p) for p in quirky)}: Megatron-DeepSpeed --append-eod "
            "index(es), whose sizes leave out each document's EOD, cannot be merged with pairs "
            "that count theirs (the merged index would describe neither). Rewrite them to count "
            f"their EODs first, then merge: {fixes}")
    return quirky


def _append(builder: indexed_dataset.MMapIndexedDatasetBuilder, prefix: str,
            whole_bin: bool) -> None:
    """Every sequence and document of the pair at ``prefix`` (mmap or legacy) into ``builder``
    (``whole_bin``: its .bin's every byte, the uncounted EODs of Megatron-DeepSpeed's too)."""
    if not legacy.is_legacy_index(index_file_path(prefix)):
        builder.merge_file_(prefix, whole_bin=whole_bin)
        return
    source = legacy.LegacyIndexedDataset(prefix)
    try:
        legacy.append_to_builder(source, builder)
    finally:
        source.close()


def merge(prefixes: Sequence[str], output_prefix: str) -> tuple[int, int]:
    """Write ``output_prefix``.bin/.idx; returns (sequences, documents) written."""
    check_dtypes(prefixes)
    whole_bins = bool(uncounted_eod_inputs(prefixes))
    if whole_bins:
        print("the inputs are Megatron-DeepSpeed --append-eod pairs: merged as its merge does "
              "(whole .bin files, their uncounted EODs included)")
    first = indexed_dataset.make_dataset(prefixes[0], "infer")
    builder = indexed_dataset.MMapIndexedDatasetBuilder(
        data_file_path(output_prefix), dtype=first.dtype
    )
    first.close()
    try:
        for prefix in prefixes:
            _append(builder, prefix, whole_bins)
        builder.finalize(index_file_path(output_prefix))
    except BaseException:
        builder.abort()
        tmp_idx = index_file_path(output_prefix) + ".tmp"
        if os.path.exists(tmp_idx):
            os.remove(tmp_idx)
        raise
    merged = MMapIndexedDataset(output_prefix)
    counts = len(merged), len(merged.doc_idx) - 1
    merged.close()
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", "--datasets", nargs="+", required=True, dest="input",
                        help="a directory of .bin/.idx pairs, or dataset prefixes in order "
                             "(--datasets: Megatron-DeepSpeed's spelling)")
    parser.add_argument("--output-prefix", required=True, help="merged dataset path prefix")
    parser.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                        help="only mmap (Megatron's default format) is written")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.time()
    try:
        check_output_dir(args.output_prefix)
        prefixes = resolve_prefixes(args.input, args.output_prefix)
        print(f"Merging {len(prefixes)} datasets into {args.output_prefix}")
        sequences, documents = merge(prefixes, args.output_prefix)
    except (MergeError, IndexedDatasetError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk while writing: the partial output is already removed
        print(f"error: writing {args.output_prefix}.bin/.idx: {e}", file=sys.stderr)
        return 1
    print(f"Done: {documents} documents, {sequences} sequences in {time.time() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

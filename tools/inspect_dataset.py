#!/usr/bin/env python
"""Show what a Megatron ``.bin``/``.idx`` dataset holds, and with ``--check`` verify it.

    python tools/inspect_dataset.py my-gpt2_text_document --docs 3 \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    python tools/inspect_dataset.py my-gpt2_text_document --check --eod 50256
    python tools/inspect_dataset.py --fix-eod-index my-gpt2_text_document

The structural checks (dtype code, pointers against sizes, the document index, the ``.bin``
length) are the ones the training loader runs when it opens a dataset
(``megatron.data.indexed_dataset.index_problems``). ``--check`` adds the EOD placement of the
first documents. Exit code 1 when a problem is found.

The index that Megatron-DeepSpeed's preprocess_data.py writes with ``--append-eod`` leaves each
document's EOD out of its sizes, so the sizes sum to fewer tokens than the ``.bin`` holds and
document k is read k tokens early (document 1 starts with document 0's EOD). The loader reads
such a pair as Megatron-DeepSpeed does, with a warning, and so does this tool (the warning is
printed, not a problem). ``--fix-eod-index PREFIX`` rewrites its ``.idx`` to count the EODs
(atomically, keeping the original as ``PREFIX.idx.megatron-deepspeed``); the pair then reads
as the output of our preprocess_data.py for the same input.

Legacy ``lazy``/``cached`` pairs (TNTIDX, Megatron-DeepSpeed's ``--dataset-impl lazy|cached``)
are read too, told apart by the .idx's magic (``--data-impl infer``, the default) or named with
``--data-impl``; their reader refuses a .bin that does not match the index when it opens.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import legacy_indexed_dataset as legacy  # noqa: E402
from megatron.data.eod_index import fix_uncounted_eod_index  # noqa: E402
from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError,
    MMapIndexedDataset,
    UncountedEod,
    data_file_path,
    find_uncounted_eod,
    index_file_path,
    layout_problems,
    sequences_end,
    uncounted_eod_message,
)
from megatron.tokenizer import build_tokenizer

Dataset = Union[MMapIndexedDataset, legacy.LegacyIndexedDataset]


def open_dataset(prefix: str, impl: str = "infer") -> Dataset:
    """The pair at ``prefix`` as ``impl`` (mmap, lazy, cached, or infer: the .idx's magic
    decides); an mmap pair is opened unverified so that a broken one is described rather than
    only refused."""
    if impl == "infer":
        idx = index_file_path(prefix)
        legacy_pair = os.path.isfile(idx) and legacy.is_legacy_index(idx)
        impl = "lazy" if legacy_pair else "mmap"
    if impl in legacy.LEGACY_IMPLS:
        return legacy.LegacyIndexedDataset(prefix, cached=impl == "cached")
    return MMapIndexedDataset(prefix, verify=False)


def _format(dataset: Dataset) -> str:
    if isinstance(dataset, MMapIndexedDataset):
        return "mmap (MMIDIDX)"
    return "legacy lazy/cached (TNTIDX)"


def summary(dataset: Dataset) -> dict:
    sizes = dataset.sizes
    doc_idx = dataset.doc_idx
    bin_bytes = os.path.getsize(data_file_path(dataset.path_prefix))
    return {
        "format": _format(dataset),
        "dtype": str(dataset.dtype),
        "sequences": len(sizes),
        "documents": len(doc_idx) - 1,
        "empty documents": int(np.sum(np.diff(doc_idx) == 0)),
        "tokens (sum of sizes)": int(sizes.sum(dtype=np.int64)),
        "tokens in .bin": bin_bytes // dataset.dtype.itemsize,
    }


def document(dataset: Dataset, d: int) -> np.ndarray:
    """All tokens of document ``d`` as the reader returns them."""
    start, end = int(dataset.doc_idx[d]), int(dataset.doc_idx[d + 1])
    parts = [dataset[i] for i in range(start, end)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dataset.dtype)


def check(dataset: Dataset, eod: Optional[int]) -> list[str]:
    """Problems found in the dataset (empty when it is consistent): the structural checks the
    loader runs at open (indexed_dataset.index_problems), then, when the tokens can be read,
    the EOD placement of the first documents (not for Megatron-DeepSpeed's --append-eod
    index, whose documents start with an EOD as its reader reads them)."""
    problems = structural_problems(dataset)
    if eod is not None and _readable(dataset) and uncounted_eod(dataset) is None:
        problems += _check_eod(dataset, eod)
    return problems


def uncounted_eod(dataset: Dataset) -> Optional[UncountedEod]:
    """The Megatron-DeepSpeed --append-eod quirk of an mmap pair (None for any other)."""
    if not isinstance(dataset, MMapIndexedDataset):
        return None
    bin_path = data_file_path(dataset.path_prefix)
    return find_uncounted_eod(dataset.index, bin_path, os.path.getsize(bin_path))


def structural_problems(dataset: Dataset) -> list[str]:
    """The loader's checks of an mmap pair; none for a legacy pair, whose reader refused a
    .bin that does not match its index when it opened."""
    return dataset.problems() if isinstance(dataset, MMapIndexedDataset) else []


def _readable(dataset: Dataset) -> bool:
    """Whether the sequences can be read as the index lays them out (a longer .bin can)."""
    if not isinstance(dataset, MMapIndexedDataset):
        return True
    bin_bytes = os.path.getsize(data_file_path(dataset.path_prefix))
    return not layout_problems(dataset.index) and bin_bytes >= sequences_end(dataset.index)


def _check_eod(dataset: Dataset, eod: int, sample: int = 1000) -> list[str]:
    problems = []
    documents = len(dataset.doc_idx) - 1
    starts, ends, nonempty = 0, 0, 0
    for d in range(min(documents, sample)):
        tokens = document(dataset, d)
        if len(tokens) == 0:
            continue
        nonempty += 1
        starts += int(d > 0 and tokens[0] == eod)
        ends += int(tokens[-1] == eod)
    if starts:
        problems.append(f"{starts} of the first {nonempty} non-empty documents start with the "
                        f"EOD id {eod} (an index whose sizes leave out the EOD)")
    if 0 < ends < nonempty:
        problems.append(f"only {ends} of the first {nonempty} non-empty documents end with the "
                        f"EOD id {eod}")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", nargs="?", help="dataset path without .bin/.idx")
    parser.add_argument("--fix-eod-index", metavar="PREFIX", default=None,
                        help="rewrite the .idx of Megatron-DeepSpeed's --append-eod dataset "
                             "PREFIX to count each document's EOD (atomically; the original "
                             "is kept as PREFIX.idx.megatron-deepspeed)")
    parser.add_argument("--docs", type=int, default=2, help="documents to print")
    parser.add_argument("--check", action="store_true", help="verify; exit 1 on a problem")
    parser.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default="infer",
                        choices=("infer", "mmap", *legacy.LEGACY_IMPLS),
                        help="the pair's format (default: infer, from the .idx's magic)")
    parser.add_argument("--eod", type=int, default=None,
                        help="end-of-document id to check for (default: the tokenizer's)")
    parser.add_argument("--tokenizer-type", default=None)
    parser.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--tokenizer-name-or-path", default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    return parser


def _tokenizer(args):
    if args.tokenizer_type is None and args.vocab_file is None:
        return None
    return build_tokenizer(args.tokenizer_type or "GPT2BPETokenizer", args.vocab_file,
                           args.merge_file, args.tokenizer_name_or_path, args.vocab_size)


def _strip_suffix(prefix: str) -> str:
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def fix_eod_index(prefix: str) -> int:
    """--fix-eod-index: rewrite the index; one line saying what changed, or an error."""
    try:
        quirk, backup = fix_uncounted_eod_index(prefix)
    except (IndexedDatasetError, OSError) as e:
        print(f"error: --fix-eod-index: {e}", file=sys.stderr)
        return 1
    print(f"{index_file_path(prefix)}: rewritten to count the EOD (id {quirk.eod}) of each of "
          f"its {quirk.documents} non-empty documents; the .bin is unchanged, and the "
          f"original index is kept as {backup}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fix_eod_index is not None:
        if args.prefix is not None:
            parser.error("give the dataset once: --fix-eod-index PREFIX")
        return fix_eod_index(_strip_suffix(args.fix_eod_index))
    if args.prefix is None:
        parser.error("the dataset PREFIX is required")
    prefix = _strip_suffix(args.prefix)
    try:
        tokenizer = _tokenizer(args)
        dataset = open_dataset(prefix, args.data_impl)
    except (IndexedDatasetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(prefix)
    for name, value in summary(dataset).items():
        print(f"  {name}: {value}")
    if _readable(dataset):
        _print_documents(dataset, args.docs, tokenizer)
    else:
        print("  documents not shown: the index does not fit the .bin (see PROBLEM)")
    eod = args.eod if args.eod is not None else getattr(tokenizer, "eod", None)
    problems = check(dataset, eod) if args.check else structural_problems(dataset)
    quirk = uncounted_eod(dataset)
    if quirk is not None:
        print(f"WARNING: {uncounted_eod_message(prefix, quirk)}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if args.check or problems:
        print("check: " + ("FAILED" if problems else "OK"))
    return 1 if problems else 0


def _print_documents(dataset: Dataset, count: int, tokenizer) -> None:
    for d in range(min(count, len(dataset.doc_idx) - 1)):
        tokens = document(dataset, d)
        print(f"  document {d}: {len(tokens)} tokens: {tokens[:32].tolist()}"
              + (" ..." if len(tokens) > 32 else ""))
        if tokenizer is not None:
            print(f"    {tokenizer.detokenize(tokens[:200].tolist())!r}")


if __name__ == "__main__":
    sys.exit(main())

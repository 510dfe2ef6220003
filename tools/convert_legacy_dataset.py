#!/usr/bin/env python
"""Convert Megatron's legacy ``lazy``/``cached`` dataset (TNTIDX .idx) to the mmap format.

    python tools/convert_legacy_dataset.py --input old_text_document --output-prefix new_text_document

The same sequences and documents, written as an ``MMIDIDX`` .bin/.idx pair (under temporary
names until complete). ``--dtype`` chooses the token type of the new .bin; by default it keeps
the legacy one (Megatron-DeepSpeed wrote int32; uint16 halves the size when every id is below
65536, and the conversion refuses ids that do not fit).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError,
    MMapIndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from megatron.data.legacy_indexed_dataset import (  # noqa: E402
    LegacyIndexedDataset,
    append_to_builder,
)


def convert_to_mmap(legacy_prefix: str, out_prefix: str,
                    dtype: Optional[Any] = None) -> None:
    """Write the legacy pair at ``legacy_prefix`` as an mmap pair at ``out_prefix`` (same
    sequences and documents; element ``dtype`` kept unless given)."""
    source = LegacyIndexedDataset(legacy_prefix)
    builder = MMapIndexedDatasetBuilder(data_file_path(out_prefix), dtype=dtype or source.dtype)
    try:
        append_to_builder(source, builder)
    except BaseException:
        builder.abort()
        raise
    finally:
        source.close()
    builder.finalize(index_file_path(out_prefix))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="legacy dataset prefix (no .bin/.idx)")
    parser.add_argument("--output-prefix", required=True, help="mmap dataset prefix to write")
    parser.add_argument("--dtype", default=None, choices=["uint16", "int32", "int64"],
                        help="token type of the new .bin (default: the legacy one)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert_to_mmap(args.input, args.output_prefix, args.dtype)
    except (IndexedDatasetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())

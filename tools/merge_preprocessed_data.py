#!/usr/bin/env python
"""Alias of tools/merge_datasets.py under Megatron-DeepSpeed's name; it takes that tool's flags
too (``--datasets PREFIX ... --output-prefix OUT [--dataset-impl mmap]``) beside ``--input``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from merge_datasets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Alias of tools/merge_datasets.py (the name some Megatron-DeepSpeed guides use)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from merge_datasets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

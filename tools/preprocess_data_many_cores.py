#!/usr/bin/env python
"""Alias of tools/preprocess_data.py for Megatron-DeepSpeed's many-cores entry point.

Same flags; use ``--partitions N`` with ``--workers`` a multiple of N to process N contiguous
parts of the input concurrently and merge them in order.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

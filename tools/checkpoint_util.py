#!/usr/bin/env python
"""Megatron-LM's older name of tools/checkpoint/convert.py: the same command and flags.

    python tools/checkpoint_util.py --model-type GPT --loader megatron --saver megatron \\
        --load-dir ckpt/tp2 --save-dir ckpt/tp1 --target-tensor-parallel-size 1
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.checkpoint.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

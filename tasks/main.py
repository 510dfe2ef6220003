"""Megatron's task entry: zero-shot evaluation of a GPT checkpoint.

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens \
        --overlapping-eval 32 --load CKPT <model and tokenizer flags of pretrain_gpt.py>
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl [--strict-lambada] ...

Under torchrun at any tensor/pipeline layout (the checkpoint's own loads file by file; another
is merged and cut in memory). See
megatron/inference/evaluation/cli.py (and tools/evaluate.py for a shorter command).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.inference.evaluation.cli import main  # noqa: E402

if __name__ == "__main__":
    main()

"""Zero-shot evaluation of a checkpoint or a local HF GPT-2 folder, with less to type than
tasks/main.py (the same code underneath).

    python tools/evaluate.py wikitext wiki.test.tokens --load CKPT [--stride 32]
    python tools/evaluate.py lambada lambada_test.jsonl --load CKPT [--strict]
    python tools/evaluate.py wikitext wiki.test.tokens --hf-model ./gpt2
    python tools/evaluate.py wikitext wiki.test.tokens --load CKPT_DS    # DeepSpeed's, as saved
    torchrun --nproc_per_node 2 tools/evaluate.py wikitext FILE --load CKPT_SAVED_AT_TP2

The model's shape, tokenizer and tensor/pipeline layout come from the checkpoint unless
given; any pretrain_gpt.py flag may follow. See megatron/inference/evaluation/friendly.py.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.inference.evaluation.friendly import main  # noqa: E402

if __name__ == "__main__":
    main()

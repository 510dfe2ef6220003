#!/bin/bash
# Llama 3 8B (Meta 2024): 32 layers, hidden 4096, 32 query heads in 8 key/value groups, SwiGLU
# width 14336, RMSNorm, RoPE base 500000, 8192 tokens, vocabulary 128256 (its tiktoken
# tokenizer.model, original/ in Meta's release); bf16, flash attention, the distributed
# optimizer, sequence parallelism; AdamW (0.9, 0.95, eps 1e-5), lr 3e-4 cosine to 3e-5.
#
#     bash examples/llama/train_llama3_8b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#         TOKENIZER_MODEL [pretrain_gpt.py flags]
#
# Layouts (tools/plan.py with these flags, --gpu-memory-gb 80; tensor 1 does not fit:
# 94 GB): 8 GPUs (default): tensor 2 x data 4, global batch 128 x 8192 tokens, 53 GB per GPU;
# 64 GPUs (NUM_NODES=8): tensor 2 x data 32, global batch 512 (4M tokens), 43 GB.
# The environment variables are those of train_llama2_7b_distributed.sh (DATA_PATH defaults
# to $DATASET_PATH/llama3_text_document, preprocessed with --tokenizer-type Llama3Tokenizer).
set -euo pipefail
NUM_LAYERS=32; HIDDEN=4096; HEADS=32; QUERY_GROUPS=8; FFN=14336; SEQ=8192
NORM_EPS=1e-5; ROPE_BASE=500000; TOKENIZER_TYPE=Llama3Tokenizer; DATA_NAME=llama3
TP_8=2; TP_64=2; GLOBAL_BATCH_8=128; GLOBAL_BATCH_64=512
# 15T tokens of 8192; 2000 warm-up steps of 512 sequences
TRAIN_SAMPLES=1831054687; WARMUP_SAMPLES=1024000; DECAY_SAMPLES=1831054687
source "$(dirname "${BASH_SOURCE[0]}")/train_llama.sh" "$@"

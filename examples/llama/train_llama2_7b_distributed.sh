#!/bin/bash
# Llama 2 7B (Touvron et al. 2023): 32 layers, hidden 4096, 32 heads, SwiGLU width 11008,
# RMSNorm, RoPE, 4096 tokens, vocabulary 32000 (its SentencePiece tokenizer.model); bf16,
# flash attention, the distributed optimizer; AdamW (0.9, 0.95, eps 1e-5), lr 3e-4 cosine to
# 3e-5 over 2T tokens after 2000 warm-up steps of 4M tokens.
#
#     bash examples/llama/train_llama2_7b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#         TOKENIZER_MODEL [pretrain_gpt.py flags]
#
# Layouts (tools/plan.py with these flags, --gpu-memory-gb 80): 8 GPUs (the default,
# GPUS_PER_NODE=8 NUM_NODES=1): data parallel 8, global batch 256 x 4096 tokens, 63 GB per GPU;
# 64 GPUs (NUM_NODES=8): data parallel 64, global batch 1024 (Llama 2's 4M tokens), 54 GB.
# Run it on every node with:
#   NODE_RANK, MASTER_ADDR, MASTER_PORT   as for torchrun (defaults 0, localhost, 6000)
#   DATASET_PATH   holds the data (default /data); DATA_PATH the prefix or blend, default
#                  $DATASET_PATH/llama2_text_document: python tools/preprocess_data.py
#                  --tokenizer-type Llama2Tokenizer --tokenizer-model TOKENIZER_MODEL --append-eod
#   DATASETCACHE   --data-cache-path (default $DATASET_PATH/index-cache)
#   TP, PP         another layout; PRECISION bf16 (default), fp16 or fp32
#   TRAIN_ITERS    train this many iterations instead of the 2T tokens
#   SAVE_CHECKPOINTS=0   load from CHECKPOINT_PATH but never save
#   DS_ARGS        passed on as they are ("--deepspeed --deepspeed_config ds.json --zero-stage 1")
#   CPU_SMOKE=1    the same flags at toy size on this machine's CPU: 4 processes (tensor 2 x
#                  pipeline 2), 4 layers of 64, fp32, 2 iterations
#   REHEARSE=1     rehearse the launch here (every rank's set-up and first iteration over a
#                  fake process group); shrink with --rehearse-hidden-size 64
#                  --rehearse-seq-length 8 after TOKENIZER_MODEL
# Flags after TOKENIZER_MODEL are passed to pretrain_gpt.py; a later flag overrides the script's.
set -euo pipefail
NUM_LAYERS=32; HIDDEN=4096; HEADS=32; QUERY_GROUPS=32; FFN=11008; SEQ=4096
NORM_EPS=1e-5; ROPE_BASE=10000; TOKENIZER_TYPE=Llama2Tokenizer; DATA_NAME=llama2
TP_8=1; TP_64=1; GLOBAL_BATCH_8=256; GLOBAL_BATCH_64=1024
# 2T tokens of 4096; 2000 warm-up steps of 1024 sequences
TRAIN_SAMPLES=488281250; WARMUP_SAMPLES=2048000; DECAY_SAMPLES=488281250
source "$(dirname "${BASH_SOURCE[0]}")/train_llama.sh" "$@"

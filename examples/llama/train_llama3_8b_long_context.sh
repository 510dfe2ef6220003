#!/bin/bash
# Llama 3 8B's long-context phase: continued training of an 8K checkpoint at 32K or 128K
# tokens (CONTEXT=32768, the default, or 131072), the RoPE base raised for the longer
# wavelengths (ROPE_BASE, default 8e6 at 32K and 3.2e7 at 128K, over pre-training's 5e5),
# each sequence split over context-parallel ranks (ring attention, --cp-comm-type p2p;
# CP_COMM_TYPE=a2a for the all-to-all). The model and the other flags are
# train_llama3_8b_distributed.sh's; --load CHECKPOINT_PATH continues from the 8K run's
# checkpoint there (or starts fresh where there is none).
#
#     CONTEXT=131072 NUM_NODES=8 bash examples/llama/train_llama3_8b_long_context.sh \
#         CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_MODEL [pretrain_gpt.py flags]
#
# Layouts (tools/plan.py with these flags, --gpu-memory-gb 80, selective recompute):
#   32K,  8 GPUs: tensor 4 x context 2, global batch 32 x 32K (1M tokens), 39.6 GB per GPU;
#   32K, 64 GPUs: tensor 4 x context 2 x data 8, global batch 128 (4M tokens), 29.8 GB;
#   128K, 8 GPUs: tensor 4 x context 2 with full recompute (selective: 91 GB, does not fit),
#                 global batch 8 (1M tokens), 37.0 GB;
#   128K, 64 GPUs: tensor 4 x context 8 x data 2, global batch 32 (4M tokens), 29.8 GB.
# CPU_SMOKE=1 runs the same flags at toy size on 4 CPU processes: pipeline 2 x context 2;
# REHEARSE=1 rehearses the launch over a fake process group (the ring's sends matched). The
# environment variables are otherwise train_llama2_7b_distributed.sh's.
set -euo pipefail
CONTEXT=${CONTEXT:-32768}
NUM_LAYERS=32; HIDDEN=4096; HEADS=32; QUERY_GROUPS=8; FFN=14336; SEQ=$CONTEXT
NORM_EPS=1e-5; TOKENIZER_TYPE=Llama3Tokenizer; DATA_NAME=${DATA_NAME:-llama3_long}
TP_8=4; TP_64=4
case "$CONTEXT" in
    32768) ROPE_BASE=${ROPE_BASE:-8000000}; CP_8=2; CP_64=2
           GLOBAL_BATCH_8=32; GLOBAL_BATCH_64=128 ;;
    131072) ROPE_BASE=${ROPE_BASE:-32000000}; CP_8=2; CP_64=8
            GLOBAL_BATCH_8=8; GLOBAL_BATCH_64=32
            if [ "${NUM_NODES:-1}" = 1 ] && [ "${CPU_SMOKE:-0}" != 1 ]; then
                RECOMPUTE=${RECOMPUTE:---recompute-granularity full --recompute-method uniform --recompute-num-layers 1}
            fi ;;
    *) echo "error: CONTEXT='$CONTEXT' is not 32768 or 131072" >&2; exit 2 ;;
esac
RECOMPUTE=${RECOMPUTE:---recompute-granularity selective}
if [ "${CPU_SMOKE:-0}" = 1 ]; then TP=${TP:-1}; PP=${PP:-2}; CP=${CP:-2}; fi
# About 20B tokens whatever the length; 50 warm-up steps of the 64-GPU batch.
TRAIN_SAMPLES=$((20000000000 / CONTEXT)); WARMUP_SAMPLES=$((50 * GLOBAL_BATCH_64))
DECAY_SAMPLES=$TRAIN_SAMPLES
source "$(dirname "${BASH_SOURCE[0]}")/train_llama.sh" "$@"

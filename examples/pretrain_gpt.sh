#!/bin/bash
# GPT-2 345M on one GPU (Megatron's examples/pretrain_gpt.sh), started as one process that
# emulates a distributed launch, as Megatron-DeepSpeed's README shows:
#
#     MASTER_ADDR=localhost MASTER_PORT=6000 RANK=0 LOCAL_RANK=0 python pretrain_gpt.py ...
#
#     bash examples/pretrain_gpt.sh CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags]
#
# MASTER_PORT (default 6000) must be free on this machine; PRECISION=fp16 (default), bf16 or
# fp32. Without a GPU it trains on the CPU (slowly: pass a smaller model after DATA_PATH).
# DATA_PATH is a preprocessed prefix or a blend ("0.3 a 0.7 b"). Flags after DATA_PATH are
# passed to pretrain_gpt.py (a later flag overrides the script's own).
set -euo pipefail

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [pretrain_gpt.py flags]" >&2
    exit 2
fi
CHECKPOINT_PATH=$1
VOCAB_FILE=$2
MERGE_FILE=$3
read -r -a DATA_PATH <<< "$4"
shift 4

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python}
# PRECISION names the number format: fp16 (the default), bf16 or fp32 (--fp16/--bf16 also work).
case "${PRECISION-fp16}" in
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac

GPT_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 8
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
    --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0
    $PRECISION_FLAG
)
DATA_ARGS=(
    --data-path "${DATA_PATH[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
)

MASTER_ADDR=${MASTER_ADDR:-localhost} MASTER_PORT=${MASTER_PORT:-6000} RANK=0 LOCAL_RANK=0 \
    "$PYTHON" "$REPO/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"

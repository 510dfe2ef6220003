#!/bin/bash
# GPT-2 345M on one or more nodes with torchrun (Megatron's examples/pretrain_gpt_distributed.sh).
#
#     bash examples/pretrain_gpt_distributed.sh CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags]
#
# DATA_PATH is a preprocessed prefix (my-gpt2_text_document) or a blend ("0.3 a 0.7 b").
# Multi-node: run it on every node with NNODES, NODE_RANK and MASTER_ADDR set.
# TP and PP set the tensor and pipeline parallel sizes; the rest of the processes are data
# parallel. PRECISION=fp16 (default), bf16 or fp32 picks the number format. Extra flags after
# DATA_PATH are passed to pretrain_gpt.py (a later flag overrides the script's own).
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
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}
PP=${PP:-1}
# PRECISION names the number format: fp16 (the default), bf16 or fp32 (--fp16/--bf16 also work).
case "${PRECISION-fp16}" in
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
GPT_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 8 --global-batch-size 64
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
    --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0
    $PRECISION_FLAG
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DATA_ARGS=(
    --data-path "${DATA_PATH[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"

#!/bin/bash
# GPT-3 175B (Megatron's recipe): tensor parallel 8 x pipeline parallel 8, batch ramp-up to
# 1536 sequences of 2048 tokens, 146M training samples (300B tokens).
#
#     bash examples/gpt3/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#         VOCAB_FILE MERGE_FILE [DATA_PATH] [flags]
#
# Run it on every node with NODE_RANK (0..NUM_NODES-1) and MASTER_ADDR set, or use
# examples/slurm/pretrain_gpt_slurm.sh's srun pattern. NUM_NODES x GPUS_PER_NODE must be a
# multiple of 64 (one model replica); the default 128 nodes x 8 GPUs gives 16 data-parallel
# replicas. DATA_PATH defaults to a blend of two preprocessed corpora under DATA_DIR:
#     "0.35 $DATA_DIR/wiki_text_document 0.65 $DATA_DIR/openwebtext_text_document"
set -euo pipefail

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE [DATA_PATH] [flags]" >&2
    exit 2
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_DIR=${DATA_DIR:-/data}
DATA_BLEND="0.35 $DATA_DIR/wiki_text_document 0.65 $DATA_DIR/openwebtext_text_document"
shift 4
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then  # a fifth argument that is not a flag
    DATA_BLEND=$1
    shift
fi
read -r -a DATA_PATH <<< "$DATA_BLEND"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-128}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
# PRECISION names the number format: fp16 (the default), bf16 or fp32 (--fp16/--bf16 also work).
case "${PRECISION-fp16}" in
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
GPT_MODEL_ARGS=(
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96
    --seq-length 2048 --max-position-embeddings 2048
    --init-method-std 0.006
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
    --train-samples 146484375
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine
    --lr-warmup-samples 183105 --lr-decay-samples 126953125
    --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    $PRECISION_FLAG
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8
    # Memory savers: same numbers, less memory per GPU.
    --sequence-parallel --use-distributed-optimizer
)
DATA_ARGS=(
    --data-path "${DATA_PATH[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 100 --save-interval 1000 --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH" --log-validation-ppl-to-tensorboard
    --exit-signal-handler
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"

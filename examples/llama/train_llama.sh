#!/bin/bash
# The launch shared by this folder's recipes (train_llama2_7b_distributed.sh,
# train_llama3_8b_distributed.sh): they set the model and its defaults, then source this file
# with CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_MODEL [pretrain_gpt.py flags].
# See either recipe for the environment variables.
set -euo pipefail

if [ $# -lt 3 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_MODEL [flags]" >&2
    exit 2
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
TOKENIZER_MODEL=$3
shift 3

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CPU_SMOKE=${CPU_SMOKE:-0}
DATASET_PATH=${DATASET_PATH:-/data}
DATA_PATH=${DATA_PATH:-$DATASET_PATH/${DATA_NAME}_text_document}
DATASETCACHE=${DATASETCACHE:-$DATASET_PATH/index-cache}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SAVE_CHECKPOINTS=${SAVE_CHECKPOINTS:-1}
TRAIN_ITERS=${TRAIN_ITERS:-}
read -r -a EXTRA_DS_ARGS <<< "${DS_ARGS:-}"
read -r -a DATA_BLEND <<< "$DATA_PATH"

if [ "$CPU_SMOKE" = 1 ]; then
    # Toy size, same flags: only the sizes below change, and --use-cpu is added.
    GPUS_PER_NODE=${GPUS_PER_NODE:-4}; NUM_NODES=${NUM_NODES:-1}; TP=${TP:-2}; PP=${PP:-2}
    CP=${CP:-1}
    if [ "$QUERY_GROUPS" = "$HEADS" ]; then QUERY_GROUPS=4; else QUERY_GROUPS=2; fi
    NUM_LAYERS=4; HIDDEN=64; HEADS=4; FFN=128; SEQ=64; GLOBAL_BATCH=4
    TRAIN_SAMPLES=8; WARMUP_SAMPLES=4; DECAY_SAMPLES=8; LOG_INTERVAL=1; EVAL_INTERVAL=2
    EVAL_ITERS=1; SAVE_INTERVAL=2; DEFAULT_PRECISION=fp32; DEVICE_ARGS=(--use-cpu)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NUM_NODES=${NUM_NODES:-1}
    WORLD=$((GPUS_PER_NODE * NUM_NODES))
    # The planner's layout for the model (python tools/plan.py ... --gpu-memory-gb 80): the
    # recipe sets TP_8/TP_64; other GPU counts take the 64-GPU one.
    if [ "$WORLD" -le 8 ]; then TP=${TP:-$TP_8}; else TP=${TP:-$TP_64}; fi
    # Context parallelism (the long-context recipe sets CP_8/CP_64; 1 otherwise).
    if [ "$WORLD" -le 8 ]; then CP=${CP:-${CP_8:-1}}; else CP=${CP:-${CP_64:-1}}; fi
    PP=${PP:-1}
    if [ "$WORLD" -le 8 ]; then GLOBAL_BATCH=$GLOBAL_BATCH_8; else GLOBAL_BATCH=$GLOBAL_BATCH_64; fi
    LOG_INTERVAL=10; EVAL_INTERVAL=1000; EVAL_ITERS=10; SAVE_INTERVAL=1000
    DEFAULT_PRECISION=bf16; DEVICE_ARGS=()
fi
case "${PRECISION-$DEFAULT_PRECISION}" in
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac
if [ -n "$TRAIN_ITERS" ]; then
    LENGTH_ARGS=(--train-iters "$TRAIN_ITERS" --lr-warmup-iters 0 --lr-decay-iters "$TRAIN_ITERS")
else
    LENGTH_ARGS=(--train-samples "$TRAIN_SAMPLES" --lr-warmup-samples "$WARMUP_SAMPLES"
                 --lr-decay-samples "$DECAY_SAMPLES")
fi
CHECKPOINT_ARGS=(--load "$CHECKPOINT_PATH")
if [ "$SAVE_CHECKPOINTS" = 1 ]; then
    CHECKPOINT_ARGS+=(--save "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL")
fi
PARALLEL_EXTRA=()
if [ "$TP" -gt 1 ]; then PARALLEL_EXTRA+=(--sequence-parallel); fi
if [ "$CP" -gt 1 ]; then
    PARALLEL_EXTRA+=(--context-parallel-size "$CP" --cp-comm-type "${CP_COMM_TYPE:-p2p}")
fi
read -r -a RECOMPUTE_ARGS <<< "${RECOMPUTE:-}"
GQA_ARGS=()
if [ "$QUERY_GROUPS" != "$HEADS" ]; then
    GQA_ARGS=(--group-query-attention --num-query-groups "$QUERY_GROUPS")
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --ffn-hidden-size "$FFN" "${GQA_ARGS[@]}"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --normalization RMSNorm --norm-epsilon "$NORM_EPS" --swiglu
    --position-embedding-type rope --rotary-base "$ROPE_BASE" --no-position-embedding
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02 --use-flash-attn
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" "${LENGTH_ARGS[@]}"
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine
    --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5
    $PRECISION_FLAG "${DEVICE_ARGS[@]}" "${RECOMPUTE_ARGS[@]}"
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    "${PARALLEL_EXTRA[@]}" --use-distributed-optimizer
)
DATA_ARGS=(
    --data-path "${DATA_BLEND[@]}" --data-cache-path "$DATASETCACHE" --split 99,1,0
    --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    "${CHECKPOINT_ARGS[@]}"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH" --log-validation-ppl-to-tensorboard
    --exit-signal-handler
)
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
          "${EVAL_AND_LOGGING_ARGS[@]}" "${EXTRA_DS_ARGS[@]}")

if [ "${REHEARSE:-0}" = 1 ]; then
    WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES)) exec python "$REPO/pretrain_gpt.py" \
        "${ALL_ARGS[@]}" --rehearse "$@"
fi
exec torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" "${ALL_ARGS[@]}" "$@"

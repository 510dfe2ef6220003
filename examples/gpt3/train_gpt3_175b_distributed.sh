#!/bin/bash
# GPT-3 175B (Megatron's recipe) on 64 GPUs: tensor parallel 8 x pipeline parallel 8, one
# model replica; global batch 1536 sequences of 2048 tokens (ramped up from 16), micro-batch 1,
# fp16, flash attention, 146M training samples (300B tokens).
#
#     bash examples/gpt3/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#         VOCAB_FILE MERGE_FILE [pretrain_gpt.py flags]
#
# Run it on every node (torchrun starts GPUS_PER_NODE processes there) with:
#   GPUS_PER_NODE=8 NUM_NODES=8   the default 64 GPUs; more nodes add data-parallel replicas
#   NODE_RANK=0..NUM_NODES-1      this node (default 0)
#   MASTER_ADDR, MASTER_PORT      where node 0 listens (default localhost, 6000)
#   DATASET_PATH                  holds the preprocessed blend (default /data):
#       0.35 $DATASET_PATH/wikipedia_20220301_en_text_document
#       0.65 $DATASET_PATH/openwebtext_Skylion007_text_document
#   DATASETCACHE                  --data-cache-path, the sample-index cache (default
#                                 $DATASET_PATH/index-cache; build it ahead with
#                                 tools/build_index_cache.py)
#   PRECISION=fp16                fp16 (the recipe's), bf16 or fp32
#   TRAIN_ITERS                   train this many iterations at the full batch instead of the
#                                 146M samples (no ramp-up); what the _tgs.sh variant uses
#   SAVE_CHECKPOINTS=1            0: load from CHECKPOINT_PATH but never save
#   DS_ARGS                       passed on to pretrain_gpt.py as they are, e.g.
#                                 "--deepspeed --deepspeed_config ds.json --zero-stage 1"
#                                 (needs the --deepspeed engine, issue 12 items 1-3)
#   CPU_SMOKE=1                   the same script at toy size on this machine's CPU: 4 processes
#                                 (tensor 2 x pipeline 2), a 4-layer 64-wide GPT, fp32, 2
#                                 iterations; DATASET_PATH must hold small datasets of the
#                                 two names (the tests make them)
#   REHEARSE=1                    rehearse the launch on this machine instead of training: one
#                                 python process runs every rank's set-up and first iteration
#                                 over PyTorch's fake process group (WORLD_SIZE =
#                                 GPUS_PER_NODE x NUM_NODES) and checks that their collectives
#                                 and sends fit together (megatron/rehearsal); shrink the model
#                                 for this machine with --rehearse-hidden-size 96
#                                 --rehearse-seq-length 8 after MERGE_FILE
# Flags after MERGE_FILE are passed to pretrain_gpt.py; a later flag overrides the script's.
# Check the memory first: python tools/plan.py with the same model flags --gpu-memory-gb 80.
set -euo pipefail

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE [flags]" >&2
    exit 2
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
shift 4

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CPU_SMOKE=${CPU_SMOKE:-0}
DATASET_PATH=${DATASET_PATH:-/data}
DATASETCACHE=${DATASETCACHE:-$DATASET_PATH/index-cache}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SAVE_CHECKPOINTS=${SAVE_CHECKPOINTS:-1}
TRAIN_ITERS=${TRAIN_ITERS:-}
read -r -a EXTRA_DS_ARGS <<< "${DS_ARGS:-}"

if [ "$CPU_SMOKE" = 1 ]; then
    # Toy size, same flags: only the sizes below change, and --use-cpu is added.
    GPUS_PER_NODE=${GPUS_PER_NODE:-4}; NUM_NODES=${NUM_NODES:-1}; TP=${TP:-2}; PP=${PP:-2}
    NUM_LAYERS=4; HIDDEN=64; HEADS=4; SEQ=64; GLOBAL_BATCH=4; RAMPUP=()
    TRAIN_SAMPLES=8; WARMUP_SAMPLES=4; DECAY_SAMPLES=8; LOG_INTERVAL=1; EVAL_INTERVAL=2
    EVAL_ITERS=1; SAVE_INTERVAL=2; DEFAULT_PRECISION=fp32; DEVICE_ARGS=(--use-cpu)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NUM_NODES=${NUM_NODES:-8}; TP=${TP:-8}; PP=${PP:-8}
    NUM_LAYERS=96; HIDDEN=12288; HEADS=96; SEQ=2048; GLOBAL_BATCH=1536
    RAMPUP=(--rampup-batch-size 16 16 5859375)
    TRAIN_SAMPLES=146484375; WARMUP_SAMPLES=183105; DECAY_SAMPLES=126953125
    LOG_INTERVAL=100; EVAL_INTERVAL=1000; EVAL_ITERS=10; SAVE_INTERVAL=1000
    DEFAULT_PRECISION=fp16; DEVICE_ARGS=()
fi
# PRECISION names the number format: fp16 (the default), bf16 or fp32 (--fp16/--bf16 also work).
case "${PRECISION-$DEFAULT_PRECISION}" in
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac
if [ -n "$TRAIN_ITERS" ]; then
    LENGTH_ARGS=(--train-iters "$TRAIN_ITERS" --lr-warmup-iters 0 --lr-decay-iters "$TRAIN_ITERS")
else
    LENGTH_ARGS=("${RAMPUP[@]}" --train-samples "$TRAIN_SAMPLES"
                 --lr-warmup-samples "$WARMUP_SAMPLES" --lr-decay-samples "$DECAY_SAMPLES")
fi
CHECKPOINT_ARGS=(--load "$CHECKPOINT_PATH")
if [ "$SAVE_CHECKPOINTS" = 1 ]; then
    CHECKPOINT_ARGS+=(--save "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL")
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
GPT_MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --init-method-std 0.006 --use-flash-attn
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" "${LENGTH_ARGS[@]}"
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine
    --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    $PRECISION_FLAG "${DEVICE_ARGS[@]}"
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    # Memory savers: same numbers, less memory per GPU.
    --sequence-parallel --use-distributed-optimizer
)
DATA_ARGS=(
    --data-path 0.35 "$DATASET_PATH/wikipedia_20220301_en_text_document"
                0.65 "$DATASET_PATH/openwebtext_Skylion007_text_document"
    --data-cache-path "$DATASETCACHE"
    --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    "${CHECKPOINT_ARGS[@]}"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH" --log-validation-ppl-to-tensorboard
    --exit-signal-handler
)

if [ "${REHEARSE:-0}" = 1 ]; then
    WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES)) exec python "$REPO/pretrain_gpt.py" \
        "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
        "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${EXTRA_DS_ARGS[@]}" --rehearse "$@"
fi
torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${EXTRA_DS_ARGS[@]}" "$@"

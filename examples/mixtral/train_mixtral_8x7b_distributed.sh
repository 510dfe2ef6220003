#!/bin/bash
# Mixtral 8x7B (Jiang et al. 2024): 32 layers, hidden 4096, 32 heads in 8 query groups,
# RMSNorm, RoPE base 1e6, untied embeddings, no biases, vocabulary 32000 (its SentencePiece
# tokenizer.model), sequence 4096; every layer a mixture of 8 SwiGLU experts of width 14336,
# top-2, load-balancing loss 1e-2: 46.7B parameters, 12.9B active per token. Megatron-LM's
# recipe's training flags: bf16, micro-batch 1, global batch 256, lr 1e-4 cosine to 1e-5,
# 500 warm-up and 320K decay steps of 500K, weight decay 0.1, clipping 1.0, init std 0.01.
#
#     bash examples/mixtral/train_mixtral_8x7b_distributed.sh CHECKPOINT_PATH \
#         TENSORBOARD_LOGS_PATH TOKENIZER_MODEL [pretrain_gpt.py flags]
#
# Layout: 64 GPUs (GPUS_PER_NODE=8 NUM_NODES=8, the default): tensor 8 (sequence parallel)
# x data 8, the experts shared out over expert parallel 8 within the data ranks (one expert of
# each layer per rank; --expert-model-parallel-size, Megatron-DeepSpeed's
# --moe-expert-parallel-size), tokens sent to their experts by all-to-all, the distributed
# optimizer. tools/plan.py with these flags and --gpu-memory-gb 80: 0.91B parameters and
# 22.2 GB per GPU, 256 MB handed to the all-to-all per rank per layer per micro-batch.
# Run it on every node with:
#   NODE_RANK, MASTER_ADDR, MASTER_PORT   as for torchrun (defaults 0, localhost, 6000)
#   DATASET_PATH   holds the data (default /data); DATA_PATH the prefix or blend, default
#                  $DATASET_PATH/mixtral_text_document: python tools/preprocess_data.py
#                  --tokenizer-type Llama2Tokenizer --tokenizer-model TOKENIZER_MODEL --append-eod
#   DATASETCACHE   --data-cache-path (default $DATASET_PATH/index-cache)
#   TP, PP, EP     another layout (check it with tools/plan.py); PRECISION bf16 (default),
#                  fp16 or fp32; DISPATCHER alltoall (default) or allgather
#   TRAIN_ITERS    train this many iterations instead of the 500K steps
#   SAVE_CHECKPOINTS=0   load from CHECKPOINT_PATH but never save
#   CPU_SMOKE=1    the same flags at toy size on this machine's CPU: 4 processes (tensor 2 x
#                  data 2, expert parallel 2: 4 of the 8 experts per rank), 4 layers of 64,
#                  fp32, 2 iterations
#   REHEARSE=1     rehearse the launch here (every rank's set-up and first iteration over a
#                  fake process group, the all-to-alls matched split by split); shrink with
#                  --rehearse-hidden-size 64 --rehearse-seq-length 64 after TOKENIZER_MODEL
# Flags after TOKENIZER_MODEL are passed to pretrain_gpt.py; a later flag overrides the script's.
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
DATA_PATH=${DATA_PATH:-$DATASET_PATH/mixtral_text_document}
DATASETCACHE=${DATASETCACHE:-$DATASET_PATH/index-cache}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SAVE_CHECKPOINTS=${SAVE_CHECKPOINTS:-1}
TRAIN_ITERS=${TRAIN_ITERS:-}
read -r -a DATA_BLEND <<< "$DATA_PATH"

NUM_EXPERTS=8; TOPK=2
if [ "$CPU_SMOKE" = 1 ]; then
    # Toy size, same flags: only the sizes below change, and --use-cpu is added.
    GPUS_PER_NODE=${GPUS_PER_NODE:-4}; NUM_NODES=${NUM_NODES:-1}
    TP=${TP:-2}; PP=${PP:-1}; EP=${EP:-2}
    NUM_LAYERS=4; HIDDEN=64; HEADS=4; QUERY_GROUPS=2; FFN=128; SEQ=64; MAX_POSITIONS=64
    GLOBAL_BATCH=4; TRAIN_SAMPLES=8; WARMUP_SAMPLES=4; DECAY_SAMPLES=8
    LOG_INTERVAL=1; EVAL_INTERVAL=2; EVAL_ITERS=1; SAVE_INTERVAL=2
    DEFAULT_PRECISION=fp32; DEVICE_ARGS=(--use-cpu)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}; NUM_NODES=${NUM_NODES:-8}
    TP=${TP:-8}; PP=${PP:-1}; EP=${EP:-8}
    NUM_LAYERS=32; HIDDEN=4096; HEADS=32; QUERY_GROUPS=8; FFN=14336; SEQ=4096
    MAX_POSITIONS=32768
    # Megatron-LM's: 500K steps of 256 sequences, 500 warm-up steps, cosine over 320K.
    GLOBAL_BATCH=256; TRAIN_SAMPLES=128000000; WARMUP_SAMPLES=128000
    DECAY_SAMPLES=81920000
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
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --ffn-hidden-size "$FFN" --group-query-attention --num-query-groups "$QUERY_GROUPS"
    --seq-length "$SEQ" --max-position-embeddings "$MAX_POSITIONS"
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --position-embedding-type rope --rotary-base 1000000 --no-position-embedding
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.01 --use-flash-attn
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-router-topk "$TOPK"
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type "${DISPATCHER:-alltoall}"
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" "${LENGTH_ARGS[@]}"
    --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine
    --clip-grad 1.0 --weight-decay 0.1
    $PRECISION_FLAG "${DEVICE_ARGS[@]}"
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP" "${PARALLEL_EXTRA[@]}" --use-distributed-optimizer
)
DATA_ARGS=(
    --data-path "${DATA_BLEND[@]}" --data-cache-path "$DATASETCACHE" --split 99,1,0
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    "${CHECKPOINT_ARGS[@]}"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH" --log-validation-ppl-to-tensorboard
    --exit-signal-handler
)
ALL_ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
          "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}")

if [ "${REHEARSE:-0}" = 1 ]; then
    WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES)) exec python "$REPO/pretrain_gpt.py" \
        "${ALL_ARGS[@]}" --rehearse "$@"
fi
exec torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt.py" "${ALL_ARGS[@]}" "$@"

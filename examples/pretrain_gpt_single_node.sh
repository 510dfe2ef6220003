#!/bin/bash
# GPT-2 345M through DeepSpeed's launcher and engine (Megatron-DeepSpeed's single-node recipe),
# or any size the environment variables below give it:
#
#     bash examples/pretrain_gpt_single_node.sh CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags]
#
# which writes DeepSpeed's JSON config (DS_CONFIG) and runs `deepspeed --num_gpus N_GPUS
# pretrain_gpt.py ... --deepspeed --deepspeed_config DS_CONFIG --zero-stage ZERO_STAGE`. The
# launcher starts one process per GPU and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT (and passes --local_rank, which pretrain_gpt.py accepts). Settings (environment
# variables):
#   N_GPUS=1            processes on this node (the launcher's --num_gpus)
#   NUM_NODES           the launcher's --num_nodes (with a hostfile: the first NUM_NODES hosts)
#   HOSTFILE            the launcher's --hostfile ("host slots=8" per line); without it the
#                       launcher uses this machine only. With several hosts it starts the
#                       other nodes over pdsh/ssh (see DeepSpeed's docs), unless NODE_RANK is set
#   NODE_RANK           run this script on every host of HOSTFILE yourself, without ssh: the
#                       launcher's --no_ssh --node_rank NODE_RANK, with MASTER_ADDR the first
#                       host. Under SLURM, examples/slurm/pretrain_gpt_slurm.sh needs neither.
#   MASTER_ADDR         the launcher's --master_addr (with NODE_RANK)
#   MASTER_PORT         the launcher's --master_port (default: its own, 29500)
#   TP=1 PP=1           tensor and pipeline parallel sizes (the rest is data parallel)
#   PRECISION=fp16      fp16 (the recipe's), bf16 or fp32; also the JSON's fp16/bf16 section
#   MICRO_BATCH_SIZE=4 GLOBAL_BATCH_SIZE=8  --micro-batch-size/--global-batch-size and the
#                       JSON's train_micro_batch_size_per_gpu/train_batch_size (pass batch
#                       sizes here, not as flags: the engine stops where file and flags differ)
#   NUM_LAYERS=24 HIDDEN_SIZE=1024 NUM_HEADS=16 SEQ_LENGTH=1024  the model (345M by default;
#                       SEQ_LENGTH is also --max-position-embeddings)
#   TRAIN_ITERS=500000  iterations; LR_DECAY_ITERS (default 320000, or TRAIN_ITERS when that
#                       is smaller) the cosine decay's length
#   LR=0.00015          the peak learning rate
#   LOG_INTERVAL=10 SAVE_INTERVAL=500 EVAL_INTERVAL=100 EVAL_ITERS=10  logging, checkpoints
#                       and evaluation (EVAL_ITERS=0: none)
#   ZERO_STAGE=1        the JSON's zero_optimization.stage and --zero-stage (2 and 3 need
#                       PP=1: the plain model, --no-pipeline-parallel, runs in the engine)
#   DS_CONFIG           where the JSON is written (default: CHECKPOINT_PATH/ds_config.json)
#   USE_DEEPSPEED=1     0: no JSON and no --deepspeed flags: the launcher runs our own engine
#   DS_ARGS             passed on as they are after the script's DeepSpeed flags, e.g.
#                       "--partition-activations"
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
N_GPUS=${N_GPUS:-1}
TP=${TP:-1}
PP=${PP:-1}
read -r -a EXTRA_DS_ARGS <<< "${DS_ARGS:-}"
# PRECISION names the number format: fp16 (the default), bf16 or fp32 (--fp16/--bf16 also work).
case "${PRECISION-fp16}" in
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac

LAUNCHER_ARGS=(--num_gpus "$N_GPUS")
if [ -n "${NUM_NODES:-}" ]; then LAUNCHER_ARGS+=(--num_nodes "$NUM_NODES"); fi
if [ -n "${HOSTFILE:-}" ]; then LAUNCHER_ARGS+=(--hostfile "$HOSTFILE"); fi
if [ -n "${NODE_RANK:-}" ]; then LAUNCHER_ARGS+=(--no_ssh --node_rank "$NODE_RANK"); fi
if [ -n "${MASTER_ADDR:-}" ]; then LAUNCHER_ARGS+=(--master_addr "$MASTER_ADDR"); fi
if [ -n "${MASTER_PORT:-}" ]; then LAUNCHER_ARGS+=(--master_port "$MASTER_PORT"); fi

MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
ZERO_STAGE=${ZERO_STAGE:-1}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-1024}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$(( TRAIN_ITERS < 320000 ? TRAIN_ITERS : 320000 ))}
LR=${LR:-0.00015}
LOG_INTERVAL=${LOG_INTERVAL:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-10}

GPT_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --lr "$LR" --train-iters "$TRAIN_ITERS"
    --lr-decay-iters "$LR_DECAY_ITERS" --lr-decay-style cosine --lr-warmup-fraction .01
    $PRECISION_FLAG
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DATA_ARGS=(
    --data-path "${DATA_PATH[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval "$LOG_INTERVAL" --save-interval "$SAVE_INTERVAL"
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --checkpoint-activations
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
)

# DeepSpeed's JSON, as Megatron-DeepSpeed's examples write it; gradient clipping and the
# loss-scale settings not named here come from the flags.
DEEPSPEED_ARGS=()
if [ "${USE_DEEPSPEED:-1}" != 0 ]; then
    DS_CONFIG=${DS_CONFIG:-$CHECKPOINT_PATH/ds_config.json}
    mkdir -p "$(dirname "$DS_CONFIG")"
    case "$PRECISION_FLAG" in
        --fp16) PRECISION_JSON='"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},' ;;
        --bf16) PRECISION_JSON='"bf16": {"enabled": true},' ;;
        *) PRECISION_JSON= ;;
    esac
    cat > "$DS_CONFIG" <<EOT
{
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "steps_per_print": 10,
  "zero_optimization": {"stage": $ZERO_STAGE},
  $PRECISION_JSON
  "wall_clock_breakdown": false
}
EOT
    DEEPSPEED_ARGS=(--deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
                    --deepspeed-activation-checkpointing)
    # Megatron-DeepSpeed runs the plain model in the engine when there is no pipeline.
    if [ "$PP" = 1 ]; then DEEPSPEED_ARGS+=(--no-pipeline-parallel); fi
fi

deepspeed "${LAUNCHER_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    "${DEEPSPEED_ARGS[@]}" "${EXTRA_DS_ARGS[@]}" "$@"

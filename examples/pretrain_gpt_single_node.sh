#!/bin/bash
# GPT-2 345M through DeepSpeed's launcher (Megatron-DeepSpeed's single-node recipe):
#
#     bash examples/pretrain_gpt_single_node.sh CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags]
#
# which runs `deepspeed --num_gpus N_GPUS pretrain_gpt.py ...`. The launcher starts one process
# per GPU and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and passes
# --local_rank, which pretrain_gpt.py accepts). Settings (environment variables):
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
#   PRECISION=fp16      fp16 (the recipe's), bf16 or fp32
#   DS_ARGS             passed on as they are, e.g. "--deepspeed --deepspeed_config ds.json
#                       --zero-stage 1" (needs the --deepspeed engine, issue 12 items 1-3);
#                       without them the launcher runs our own engine
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

GPT_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 8
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
    --lr-warmup-fraction .01
    $PRECISION_FLAG
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DATA_ARGS=(
    --data-path "${DATA_PATH[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval 10 --save-interval 500 --eval-interval 100 --eval-iters 10
    --checkpoint-activations
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
)

deepspeed "${LAUNCHER_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    "${EXTRA_DS_ARGS[@]}" "$@"

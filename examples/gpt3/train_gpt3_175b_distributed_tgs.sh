#!/bin/bash
# Throughput of the GPT-3 175B recipe: 10 iterations of train_gpt3_175b_distributed.sh at the
# full global batch (1536 sequences, no ramp-up, no evaluation, no checkpoint saved), then
# tokens per GPU per second (TGS) and TFLOP/s per GPU read from the Megatron log lines.
#
#     bash examples/gpt3/train_gpt3_175b_distributed_tgs.sh CHECKPOINT_PATH \
#         TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE [pretrain_gpt.py flags]
#
# Same variables as train_gpt3_175b_distributed.sh (GPUS_PER_NODE, NUM_NODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT, DATASET_PATH, DATASETCACHE, PRECISION, DS_ARGS, CPU_SMOKE=1), and
#   TGS_ITERS=10        iterations to run
#   TGS_SKIP=1          first iterations left out of the means (start-up, allocator warm-up)
#   LOG_FILE            where the run's standard output goes (default
#                       TENSORBOARD_LOGS_PATH/tgs.log)
# CHECKPOINT_PATH is loaded from when it holds a checkpoint, never written. Global rank 0
# prints the log lines, so the figures appear on node 0 (NODE_RANK=0).
set -euo pipefail

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE [flags]" >&2
    exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TGS_ITERS=${TGS_ITERS:-10}
TGS_SKIP=${TGS_SKIP:-1}
LOG_FILE=${LOG_FILE:-$2/tgs.log}
mkdir -p "$(dirname "$LOG_FILE")"

TRAIN_ITERS=$TGS_ITERS SAVE_CHECKPOINTS=0 bash "$HERE/train_gpt3_175b_distributed.sh" "$@" \
    --log-interval 1 --eval-iters 0 | tee "$LOG_FILE"  # log lines are on stdout

# The means over iterations TGS_SKIP+1 .. TGS_ITERS of the log line's two throughput fields.
awk -v skip="$TGS_SKIP" -v log_file="$LOG_FILE" '
    / iteration +[0-9]+\/ +[0-9]+ \|/ && /TGS\): / {
        split($0, it, /iteration +/); split(it[2], n, "/")
        if (n[1] + 0 <= skip) next
        split($0, a, /tokens per GPU per second \(TGS\): /); split(a[2], tgs, " ")
        split($0, b, /TFLOP\/s per GPU: /); split(b[2], tf, " ")
        count++; tgs_sum += tgs[1]; tflops_sum += tf[1]
        if (first == "") first = n[1]
        last = n[1]
    }
    END {
        if (count == 0) {
            print "no iteration log lines after iteration " skip " in " log_file \
                  " (global rank 0 prints them: read node 0)"
            exit 0
        }
        printf "throughput over iterations %d-%d (%d logged):\n", first, last, count
        printf "  tokens per GPU per second (TGS): %.1f\n", tgs_sum / count
        printf "  TFLOP/s per GPU: %.3f\n", tflops_sum / count
    }' "$LOG_FILE"

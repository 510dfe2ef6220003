#!/bin/bash
# GPT-2 345M on a SLURM cluster: srun starts one task per GPU, and each task finds everything
# it needs in the variables srun sets: its rank (SLURM_PROCID), the world size (SLURM_NTASKS),
# its GPU (SLURM_LOCALID), and where rank 0 listens: the first host of SLURM_JOB_NODELIST,
# expanded in Python (gpu[001-008] -> gpu001), on MASTER_PORT or 6000. No scontrol, ssh,
# hostfile or node rank is needed; set MASTER_ADDR/MASTER_PORT to override.
#
#     sbatch examples/slurm/pretrain_gpt_slurm.sh CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags]
#
# Adjust the #SBATCH lines to your cluster; TP and PP set the tensor and pipeline parallel
# sizes, the rest of the tasks are data parallel; PRECISION=fp16 (default), bf16 or fp32 picks
# the number format. Extra flags after DATA_PATH are passed to pretrain_gpt.py.
#
# Preemption and time limits. Every task saves a checkpoint and exits cleanly on SIGTERM
# (--exit-signal-handler), sent to the tasks (`scancel --signal=TERM JOBID`) or to this script
# (`scancel --signal=TERM --batch JOBID`, or the time limit's `--signal=B:TERM@300` below),
# which passes it on to every task through scancel; not with `scancel --full`, which also
# signals srun, and srun answers a SIGTERM of its own by killing its tasks. The job can be
# requeued (--requeue): after `scontrol requeue JOBID` this script runs again, resumes from the
# checkpoint (--load) and appends to the same log (--open-mode=append). REQUEUE_ON_TERM=1 makes
# the job requeue itself after such a save, to train on across time-limited allocations.
#SBATCH --job-name=megatron-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --exclusive
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

if [ $# -lt 4 ]; then
    echo "usage: sbatch $0 CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH [pretrain_gpt.py flags]" >&2
    exit 2
fi
CHECKPOINT_PATH=$1
VOCAB_FILE=$2
MERGE_FILE=$3
read -r -a DATA_PATH <<< "$4"
shift 4
# PRECISION names the number format: fp16 (the default), bf16 or fp32 (--fp16/--bf16 also work).
case "${PRECISION-fp16}" in
    fp16 | --fp16) PRECISION_FLAG=--fp16 ;;
    bf16 | --bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "error: PRECISION='$PRECISION' is not one of fp32, bf16, fp16" >&2; exit 2 ;;
esac

# sbatch runs a copy of this script: find the repository from where it was submitted.
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
if [ ! -f "$REPO/pretrain_gpt.py" ]; then
    echo "error: no pretrain_gpt.py in $REPO: submit from the repository root or set REPO" >&2
    exit 2
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
TP=${TP:-2}
PP=${PP:-1}

GPT_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 256
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
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --exit-signal-handler
)

# srun runs in the background so that this shell can pass SIGTERM on while it waits.
srun --kill-on-bad-exit=1 python "$REPO/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@" &
SRUN_PID=$!
TERM_RECEIVED=0
forward_term() {
    TERM_RECEIVED=1
    echo "SIGTERM: every task saves a checkpoint and stops" >&2
    # Through SLURM, to every task: srun turns a SIGTERM of its own into SIGKILL of its tasks.
    scancel --signal=TERM "$SLURM_JOB_ID" || true
}
trap forward_term TERM
status=0
wait "$SRUN_PID" || status=$?
while [ "$status" -gt 128 ] && kill -0 "$SRUN_PID" 2>/dev/null; do
    status=0  # the signal interrupted wait, not srun: wait for srun's own status
    wait "$SRUN_PID" || status=$?
done
if [ "$status" -eq 0 ] && [ "$TERM_RECEIVED" = 1 ] && [ "${REQUEUE_ON_TERM:-0}" = 1 ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"

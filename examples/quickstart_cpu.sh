#!/usr/bin/env bash
# Pre-train a small GPT on CPU, offline, from nothing but this repository:
#
#     bash examples/quickstart_cpu.sh
#
# 1. builds a corpus as loose JSON: WikiText-2 from ../shared/data/wikitext-2 when present,
#    else Python's own documentation (every Python has it), or your file (CORPUS_JSON);
# 2. trains a GPT-2-style byte-level BPE tokenizer on it (or uses VOCAB_FILE/MERGE_FILE);
# 3. tokenizes it with tools/preprocess_data.py into Megatron .bin/.idx files;
# 4. trains a 4-layer GPT with tensor parallelism 2 through torchrun, with the Megatron log
#    line, evaluation, TensorBoard and checkpoints: on the CPU (gloo), or on GPUs (NCCL) when
#    the machine has one per process (DEVICE=cpu keeps it on the CPU);
# 5. samples a few lines from the checkpoint it trained (tools/generate_text.py, at the
#    checkpoint's tensor x pipeline layout).
#
# Everything goes into OUT_DIR (default ./quickstart). Re-running reuses what was built; a
# finished training run is not repeated (raise TRAIN_ITERS to train on from its checkpoint).
#
# Settings (environment variables):
#   OUT_DIR=./quickstart      output folder
#   CORPUS_JSON=              your own corpus: one {"text": "..."} JSON object per line
#   WIKITEXT_DIR=             WikiText-2's raw text (must hold some); unset: ../shared/data/
#                             wikitext-2 if present, else Python's own documentation
#   VOCAB_FILE= MERGE_FILE=   use these GPT-2-format tokenizer files (e.g. GPT-2's own)
#   VOCAB_SIZE=8192           size of the tokenizer trained otherwise
#   TRAIN_ITERS=150           training iterations (about 3-5 minutes on 2 CPU cores)
#   TP=2 PP=1 DP=1            tensor, pipeline and data parallel sizes (TP*PP*DP processes)
#   NUM_LAYERS=4 HIDDEN_SIZE=256 NUM_HEADS=8 SEQ_LENGTH=256
#   MICRO_BATCH=4 GLOBAL_BATCH=8 LR=1e-3 MIN_LR=1e-4
#   EVAL_INTERVAL=50 EVAL_ITERS=10 SAVE_INTERVAL=50 LOG_INTERVAL=10
#   DEVICE=auto               auto: GPUs when there are TP*PP*DP of them, else the CPU; cpu
#   SAMPLE_TOKENS=40          new tokens per sampled line at the end (0: no sampling)
#   PYTHON=python             the interpreter with this package installed
# Extra Megatron flags can follow on the command line: bash examples/quickstart_cpu.sh --seed 7
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
OUT_DIR="${OUT_DIR:-$PWD/quickstart}"
CORPUS_JSON="${CORPUS_JSON:-}"
WIKITEXT_DIR="${WIKITEXT_DIR:-}"
VOCAB_FILE="${VOCAB_FILE:-}"
MERGE_FILE="${MERGE_FILE:-}"
VOCAB_SIZE="${VOCAB_SIZE:-8192}"
TRAIN_ITERS="${TRAIN_ITERS:-150}"
TP="${TP:-2}"
PP="${PP:-1}"
DP="${DP:-1}"
NUM_LAYERS="${NUM_LAYERS:-4}"
HIDDEN_SIZE="${HIDDEN_SIZE:-256}"
NUM_HEADS="${NUM_HEADS:-8}"
SEQ_LENGTH="${SEQ_LENGTH:-256}"
MICRO_BATCH="${MICRO_BATCH:-4}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
LR="${LR:-1e-3}"
MIN_LR="${MIN_LR:-1e-4}"
EVAL_INTERVAL="${EVAL_INTERVAL:-50}"
EVAL_ITERS="${EVAL_ITERS:-10}"
SAVE_INTERVAL="${SAVE_INTERVAL:-50}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
DEVICE="${DEVICE:-auto}"
SAMPLE_TOKENS="${SAMPLE_TOKENS:-40}"
NPROC=$((TP * PP * DP))
START=$(date +%s)

stage() { echo "==> [$(($(date +%s) - START))s] $*"; }
fail() { echo "error: $*" >&2; exit 1; }

check_inputs() {
    "$PYTHON" -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('torch', 'tokenizers', 'megatron')))" \
        || fail "$PYTHON cannot import torch, tokenizers and megatron: run" \
                "'pip install torch==2.13.0 && pip install -e .' in $REPO first"
    if [ -n "$VOCAB_FILE$MERGE_FILE" ] && { [ ! -f "$VOCAB_FILE" ] || [ ! -f "$MERGE_FILE" ]; }; then
        fail "VOCAB_FILE and MERGE_FILE must both name existing files" \
             "(got '$VOCAB_FILE', '$MERGE_FILE')"
    fi
    if [ -n "$CORPUS_JSON" ] && [ ! -f "$CORPUS_JSON" ]; then
        fail "CORPUS_JSON=$CORPUS_JSON does not exist"
    fi
}

# Sets CORPUS (the loose JSON file) and NAME (what the corpus is called in file names).
build_corpus() {
    if [ -n "$CORPUS_JSON" ]; then
        CORPUS="$(cd "$(dirname "$CORPUS_JSON")" && pwd)/$(basename "$CORPUS_JSON")"
        NAME="$(basename "${CORPUS%.*}")"
        stage "building corpus: using your $CORPUS"
        return
    fi
    CORPUS="$OUT_DIR/corpus/builtin.json"
    NAME=builtin
    stage "building corpus: $CORPUS"
    "$PYTHON" "$REPO/tools/build_quickstart_corpus.py" corpus --output "$CORPUS" \
        ${WIKITEXT_DIR:+--wikitext-dir "$WIKITEXT_DIR"}
}

# Sets VOCAB_FILE, MERGE_FILE and TOKENIZER (its name in file names).
build_tokenizer() {
    if [ -n "$VOCAB_FILE" ]; then
        TOKENIZER="$(basename "${VOCAB_FILE%.*}")"
        stage "training tokenizer: skipped, using $VOCAB_FILE and $MERGE_FILE"
        return
    fi
    TOKENIZER="bpe$VOCAB_SIZE-$NAME"
    local dir="$OUT_DIR/tokenizer/$TOKENIZER"
    VOCAB_FILE="$dir/vocab.json"
    MERGE_FILE="$dir/merges.txt"
    stage "training tokenizer: byte-level BPE, $VOCAB_SIZE ids, into $dir"
    "$PYTHON" "$REPO/tools/build_quickstart_corpus.py" tokenizer --input "$CORPUS" \
        --output-dir "$dir" --vocab-size "$VOCAB_SIZE"
}

# Sets DATA_PATH (the dataset prefix that training reads).
preprocess() {
    local prefix="$OUT_DIR/data/$NAME-$TOKENIZER"
    DATA_PATH="${prefix}_text_document"
    if [ -f "$DATA_PATH.bin" ] && [ -f "$DATA_PATH.idx" ]; then
        stage "preprocessing: reusing $DATA_PATH.{bin,idx}"
        return
    fi
    stage "preprocessing: $CORPUS -> $DATA_PATH.{bin,idx}"
    "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$CORPUS" --output-prefix "$prefix" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
        --append-eod --workers 2 --log-interval 100000
}

train() {
    local done_iters=0
    if [ -f "$CKPT/latest_checkpointed_iteration.txt" ]; then
        done_iters="$(cat "$CKPT/latest_checkpointed_iteration.txt")"
    fi
    if [ "$done_iters" != "release" ] && [ "$done_iters" -ge "$TRAIN_ITERS" ]; then
        stage "training: skipped, $CKPT already holds iteration $done_iters" \
              "(TRAIN_ITERS=$TRAIN_ITERS)"
        return
    fi
    local cores threads gpus where device_args=()
    cores="$(nproc 2>/dev/null || echo 2)"
    threads=$((cores / NPROC > 0 ? cores / NPROC : 1))
    gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
    # NCCL wants a GPU per process; with fewer, the CPU (pretrain_gpt.py picks the GPU itself).
    if [ "$DEVICE" != "cpu" ] && [ "$gpus" -ge "$NPROC" ]; then
        where="$NPROC GPU process(es)"
    else
        where="$NPROC CPU processes"
        device_args=(--use-cpu)
    fi
    stage "training: GPT of $NUM_LAYERS layers x $HIDDEN_SIZE hidden, sequence $SEQ_LENGTH," \
          "$TRAIN_ITERS iterations of $GLOBAL_BATCH sequences, on $where" \
          "(tensor $TP x pipeline $PP x data $DP, $threads thread(s) each); log: $LOG"
    local gpt_args=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
        --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
        --lr-warmup-iters $((TRAIN_ITERS / 20 + 1)) --override-opt_param-scheduler
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
        --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0
        --make-vocab-size-divisible-by 128
    )
    local parallel_args=(
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        "${device_args[@]}"
    )
    local data_args=(
        --data-path "$DATA_PATH" --split 90,5,5 --num-workers 0
        --data-cache-path "$OUT_DIR/data/index-cache"
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    )
    local output_args=(
        --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
        --save "$CKPT" --load "$CKPT" --save-interval "$SAVE_INTERVAL" --exit-signal-handler
        --tensorboard-dir "$TB" --log-validation-ppl-to-tensorboard
    )
    OMP_NUM_THREADS="$threads" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node "$NPROC" "$REPO/pretrain_gpt.py" \
        "${gpt_args[@]}" "${parallel_args[@]}" "${data_args[@]}" "${output_args[@]}" "$@" \
        2>&1 | tee -a "$LOG"
}

# Ends as a user goes on: a few lines sampled from the trained checkpoint, one process per
# tensor x pipeline rank (the layout it was saved with), on the device training used.
sample() {
    if [ "$SAMPLE_TOKENS" = 0 ]; then
        stage "sampling: skipped (SAMPLE_TOKENS=0)"
        return
    fi
    if [ ! -f "$CKPT/latest_checkpointed_iteration.txt" ]; then
        stage "sampling: skipped (no checkpoint in $CKPT)"
        return
    fi
    local nproc=$((TP * PP)) gpus device_args=()
    gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
    if [ "$DEVICE" = "cpu" ] || [ "$gpus" -lt "$nproc" ]; then
        device_args=(--use-cpu)
    fi
    stage "sampling: $SAMPLE_TOKENS tokens after each of 3 prompts from $CKPT" \
          "(tools/generate_text.py on $nproc process(es); serve it with" \
          "tools/run_text_generation_server.py)"
    OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
        "$REPO/tools/generate_text.py" --load "$CKPT" "${device_args[@]}" \
        --max-new-tokens "$SAMPLE_TOKENS" --top-k 10 --temperature 0.8 --seed 1234 \
        --prompt "The" --prompt "In the" --prompt "It is"
}

report() {
    local last
    last="$(grep -a "validation loss at" "$LOG" 2>/dev/null | tail -n 1 || true)"
    stage "done in $(($(date +%s) - START))s."
    echo "    checkpoint:  $CKPT (iteration" \
         "$(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo none))"
    echo "    TensorBoard: tensorboard --logdir $TB"
    echo "    log:         $LOG"
    if [ -n "$last" ]; then
        echo "    last evaluation:${last#*validation loss}"
    fi
}

main() {
    check_inputs
    mkdir -p "$OUT_DIR"/{corpus,data,logs}
    OUT_DIR="$(cd "$OUT_DIR" && pwd)"
    CKPT="$OUT_DIR/checkpoints"
    TB="$OUT_DIR/tensorboard"
    LOG="$OUT_DIR/logs/train.log"
    build_corpus
    build_tokenizer
    preprocess
    train "$@"
    sample
    report
}

# Everything above is definitions: bash has read the whole file before main runs, so editing
# this script (or a git pull) during a run cannot change the running one.
main "$@"
exit 0

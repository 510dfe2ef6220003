#!/usr/bin/env bash
# The two-level V-cycle of "A Multi-Level Framework for Accelerating Training Transformer
# Models" (Zou et al., ICLR 2024) at toy size on the CPU, beside a plain run of the same
# total number of steps:
#
#     bash examples/multilevel/multilevel_pretrain.sh
#
# 1. train the large model LARGE1_ITERS steps;
# 2. coalesce it (tools/multilevel.py: half the width and half the depth);
# 3. train the small model SMALL_ITERS steps from there;
# 4. de-coalesce it and interpolate with the large checkpoint of step 1
#    ((1 - ALPHA) * large + ALPHA * de-coalesced);
# 5. train the large model LARGE2_ITERS more steps from there.
# Then a plain run of LARGE1_ITERS + SMALL_ITERS + LARGE2_ITERS steps of the large model, and
# a table of wall time and final validation loss of both. Each stage restarts the optimizer
# and the learning-rate schedule (the operators reset them) and reads the data from its start.
# Validation is run once, at the end of each run, on the same first EVAL_ITERS batches.
#
# Settings (environment variables):
#   OUT_DIR=./multilevel      output folder
#   DATA_PATH= VOCAB_FILE= MERGE_FILE=   a tokenized dataset prefix and its GPT-2-format
#                             tokenizer; unset: built like the quickstart's (Python's docs or
#                             ../shared/data/wikitext-2, a 2048-id byte-level BPE)
#   NUM_LAYERS=4 HIDDEN_SIZE=64 NUM_HEADS=4 SEQ_LENGTH=64   the large model
#   LARGE1_ITERS=40 SMALL_ITERS=60 LARGE2_ITERS=100 ALPHA=0.25
#   MICRO_BATCH=8 GLOBAL_BATCH=8 LR=1e-3 MIN_LR=1e-4 EVAL_ITERS=10 PYTHON=python
# Extra Megatron flags can follow on the command line; they go to every training run.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
OUT_DIR="${OUT_DIR:-$PWD/multilevel}"
DATA_PATH="${DATA_PATH:-}"
VOCAB_FILE="${VOCAB_FILE:-}"
MERGE_FILE="${MERGE_FILE:-}"
NUM_LAYERS="${NUM_LAYERS:-4}"
HIDDEN_SIZE="${HIDDEN_SIZE:-64}"
NUM_HEADS="${NUM_HEADS:-4}"
SEQ_LENGTH="${SEQ_LENGTH:-64}"
LARGE1_ITERS="${LARGE1_ITERS:-40}"
SMALL_ITERS="${SMALL_ITERS:-60}"
LARGE2_ITERS="${LARGE2_ITERS:-100}"
ALPHA="${ALPHA:-0.25}"
MICRO_BATCH="${MICRO_BATCH:-8}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
LR="${LR:-1e-3}"
MIN_LR="${MIN_LR:-1e-4}"
EVAL_ITERS="${EVAL_ITERS:-10}"
TOTAL_ITERS=$((LARGE1_ITERS + SMALL_ITERS + LARGE2_ITERS))

fail() { echo "error: $*" >&2; exit 1; }
stage() { echo "==> $*"; }

prepare_data() {
    if [ -n "$DATA_PATH" ]; then
        [ -f "$DATA_PATH.bin" ] && [ -f "$DATA_PATH.idx" ] \
            || fail "DATA_PATH=$DATA_PATH: $DATA_PATH.bin or $DATA_PATH.idx is missing"
        [ -f "$VOCAB_FILE" ] && [ -f "$MERGE_FILE" ] \
            || fail "with DATA_PATH, VOCAB_FILE and MERGE_FILE must name existing files"
        return
    fi
    local corpus="$OUT_DIR/data/corpus.json" tok="$OUT_DIR/data/tokenizer"
    VOCAB_FILE="$tok/vocab.json"
    MERGE_FILE="$tok/merges.txt"
    DATA_PATH="$OUT_DIR/data/corpus_text_document"
    if [ -f "$DATA_PATH.bin" ]; then
        stage "data: reusing $DATA_PATH"
        return
    fi
    stage "data: building a corpus, a tokenizer and $DATA_PATH"
    "$PYTHON" "$REPO/tools/build_quickstart_corpus.py" corpus --output "$corpus"
    "$PYTHON" "$REPO/tools/build_quickstart_corpus.py" tokenizer --input "$corpus" \
        --output-dir "$tok" --vocab-size 2048
    "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$corpus" \
        --output-prefix "$OUT_DIR/data/corpus" --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --append-eod --workers 1 \
        --log-interval 100000
}

# train NAME ITERS LAYERS HIDDEN HEADS [extra flags...]: one run, its log in $OUT_DIR/logs.
train() {
    local name="$1" iters="$2" layers="$3" hidden="$4" heads="$5"
    shift 5
    stage "train $name: $iters iterations, $layers layers x $hidden hidden, $heads heads"
    "$PYTHON" "$REPO/pretrain_gpt.py" --use-cpu \
        --num-layers "$layers" --hidden-size "$hidden" --num-attention-heads "$heads" \
        --kv-channels $((HIDDEN_SIZE / NUM_HEADS)) \
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" \
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
        --train-iters "$iters" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine \
        --lr-warmup-iters $((iters / 10 + 1)) --weight-decay 0.1 --clip-grad 1.0 \
        --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234 \
        --data-path "$DATA_PATH" --split 90,5,5 --num-workers 0 \
        --data-cache-path "$OUT_DIR/data/index-cache" --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
        --log-interval 10 --eval-interval 1000000 --eval-iters "$EVAL_ITERS" \
        --save "$OUT_DIR/ckpt/$name" --save-interval "$iters" "$@" > "$OUT_DIR/logs/$name.log" 2>&1 \
        || { tail -n 20 "$OUT_DIR/logs/$name.log" >&2; fail "training $name failed"; }
}

multilevel() {
    "$PYTHON" "$REPO/tools/multilevel.py" "$@" > /dev/null
}

final_valid_loss() {
    grep -a "validation loss at the end of training" "$OUT_DIR/logs/$1.log" | tail -n 1 \
        | sed -E 's/.*lm loss value: ([0-9.eE+-]+).*/\1/'
}

main() {
    mkdir -p "$OUT_DIR"/{data,logs}
    OUT_DIR="$(cd "$OUT_DIR" && pwd)"
    rm -rf "$OUT_DIR/ckpt"
    prepare_data
    local small_hidden=$((HIDDEN_SIZE / 2)) small_heads=$((NUM_HEADS / 2))
    local small_layers=$((NUM_LAYERS / 2)) t0 t1 t2
    t0=$(date +%s.%N)
    train large1 "$LARGE1_ITERS" "$NUM_LAYERS" "$HIDDEN_SIZE" "$NUM_HEADS" "$@"
    stage "coalesce large1 -> small0"
    multilevel coalesce --load "$OUT_DIR/ckpt/large1" --save "$OUT_DIR/ckpt/small0"
    train small "$SMALL_ITERS" "$small_layers" "$small_hidden" "$small_heads" \
        --load "$OUT_DIR/ckpt/small0" "$@"
    stage "de-coalesce small and interpolate with large1 (alpha $ALPHA) -> large2_init"
    multilevel interpolate --load "$OUT_DIR/ckpt/large1" --load-small "$OUT_DIR/ckpt/small" \
        --alpha "$ALPHA" --save "$OUT_DIR/ckpt/large2_init"
    train large2 "$LARGE2_ITERS" "$NUM_LAYERS" "$HIDDEN_SIZE" "$NUM_HEADS" \
        --load "$OUT_DIR/ckpt/large2_init" "$@"
    t1=$(date +%s.%N)
    train plain "$TOTAL_ITERS" "$NUM_LAYERS" "$HIDDEN_SIZE" "$NUM_HEADS" "$@"
    t2=$(date +%s.%N)
    echo
    echo "V-cycle ($LARGE1_ITERS large + $SMALL_ITERS small + $LARGE2_ITERS large steps) vs" \
         "plain ($TOTAL_ITERS large steps), $NUM_LAYERS layers x $HIDDEN_SIZE hidden:"
    printf "  %-8s wall time %7.1f s   final validation loss %s\n" \
        v-cycle "$(awk "BEGIN{print $t1 - $t0}")" "$(final_valid_loss large2)"
    printf "  %-8s wall time %7.1f s   final validation loss %s\n" \
        plain "$(awk "BEGIN{print $t2 - $t1}")" "$(final_valid_loss plain)"
}

main "$@"
exit 0

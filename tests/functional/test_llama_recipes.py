"""examples/llama/: the Llama 2 7B and Llama 3 8B recipes run as users run them, at toy size on
the CPU (CPU_SMOKE=1: tensor 2 x pipeline 2, the recipe's flags) and rehearsed at their real
layouts (REHEARSE=1: 8 and 64 ranks), with tokenizers built here from local text; and
Megatron-DeepSpeed's pretrain_llama2_distributed.sh flag set is accepted as written."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest

from megatron.checkpointing import read_tracker
from tests.dist_utils import free_port
from tests.distributed.training_utils import parse_log_lines
from tests.functional.test_pretrain_cli import _printed_argument
from tests.unit.tokenizer.test_llama_tokenizers import _text, _train_byte_bpe, make_sp_model

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
LLAMA2 = os.path.join(REPO, "examples", "llama", "train_llama2_7b_distributed.sh")
LLAMA3 = os.path.join(REPO, "examples", "llama", "train_llama3_8b_distributed.sh")
LONG = os.path.join(REPO, "examples", "llama", "train_llama3_8b_long_context.sh")
SHRINK = ["--rehearse-hidden-size", "64", "--rehearse-seq-length", "8"]


@pytest.fixture(scope="module")
def llama3_data(tmp_path_factory):
    """A Llama 3-style tokenizer.model and a small dataset preprocessed with it."""
    folder = tmp_path_factory.mktemp("llama3")
    model = folder / "tokenizer.model"
    ranks = _train_byte_bpe(_text(), 200)
    model.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    docs = [p for p in _text().split("\n\n") if p.strip()] * 6
    src = folder / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(src),
         "--output-prefix", str(folder / "llama3"), "--tokenizer-type", "Llama3Tokenizer",
         "--tokenizer-model", str(model), "--append-eod", "--workers", "1"],
        capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return folder, str(model)


def _script(script: str, tmp_path, model: str, *flags: str, timeout: int = 300, **env):
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), **env,
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(["bash", script, str(tmp_path / "ckpt"), str(tmp_path / "tb"), model,
                           *flags], capture_output=True, text=True, env=run_env, cwd=REPO,
                          timeout=timeout)


@pytest.mark.slow
def test_the_llama3_8b_recipe_trains_at_toy_size(llama3_data, tmp_path):
    folder, model = llama3_data
    done = _script(LLAMA3, tmp_path, model, CPU_SMOKE="1", DATASET_PATH=str(folder),
                   DATASETCACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]
    printed = {name: _printed_argument(done.stdout, name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
        "swiglu", "normalization", "num_query_groups", "untie_embeddings_and_output_weights",
        "position_embedding_type", "tokenizer_type", "rotary_base")}
    assert printed == {
        "tensor_model_parallel_size": "2", "pipeline_model_parallel_size": "2",
        "sequence_parallel": "True", "swiglu": "True", "normalization": "RMSNorm",
        "num_query_groups": "2", "untie_embeddings_and_output_weights": "True",
        "position_embedding_type": "rope", "tokenizer_type": "Llama3Tokenizer",
        "rotary_base": "500000"}
    assert read_tracker(str(tmp_path / "ckpt")).iteration == 2


@pytest.mark.slow
def test_the_long_context_recipe_splits_each_sequence_at_toy_size(llama3_data, tmp_path):
    """train_llama3_8b_long_context.sh at toy size: pipeline 2 x context 2 on 4 CPU
    processes, the raised RoPE base, the ring; a length it has no layout for is refused."""
    folder, model = llama3_data
    env = dict(CPU_SMOKE="1", DATA_PATH=str(folder / "llama3_text_document"),
               DATASETCACHE=str(tmp_path / "cache"))
    done = _script(LONG, tmp_path, model, **env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]
    printed = {name: _printed_argument(done.stdout, name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "cp_comm_type", "data_parallel_size", "rotary_base", "recompute_granularity")}
    assert printed == {
        "tensor_model_parallel_size": "1", "pipeline_model_parallel_size": "2",
        "context_parallel_size": "2", "cp_comm_type": "p2p", "data_parallel_size": "1",
        "rotary_base": "8000000", "recompute_granularity": "selective"}
    assert read_tracker(str(tmp_path / "ckpt")).iteration == 2
    bad = _script(LONG, tmp_path, model, **env, CONTEXT="4096")
    assert bad.returncode == 2 and "error: CONTEXT='4096'" in bad.stderr


def _rehearse(script: str, tmp_path, model: str, *shrink: str, **env) -> str:
    done = _script(script, tmp_path, model, *(shrink or SHRINK), REHEARSE="1", **env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "rehearsal passed:" in out
    assert not (tmp_path / "ckpt").exists()
    return out


@pytest.mark.slow
# Parameters per rank at the real width, with the test tokenizers' small vocabularies (600
# and 712 tokens; Llama's own 32000 and 128256 give 6.74 G and 4.02 G, tools/plan.py).
@pytest.mark.parametrize("script, nodes, layout, parameters", [
    (LLAMA2, "1", "tensor 1 x pipeline 1 x data 8 = 8 ranks, distributed optimizer", "6.48 G"),
    (LLAMA3, "8", "tensor 2 x pipeline 1 x data 32 = 64 ranks, sequence parallel, "
                  "distributed optimizer", "3.49 G"),
    # 32K tokens over context 2 x tensor 4 (shrunk to 64 tokens: 2 x 2 chunks of 16).
    (LONG, "8", "tensor 4 x pipeline 1 x context 2 (p2p) x data 8 = 64 ranks, sequence "
                "parallel, distributed optimizer", "1.75 G"),
])
def test_the_recipes_rehearse_at_their_layouts(llama3_data, tmp_path, script, nodes, layout,
                                               parameters):
    _, model = llama3_data
    if script == LLAMA2:  # Llama 2's tokenizer: SentencePiece
        pytest.importorskip("sentencepiece")
        (tmp_path / "sp").mkdir()
        model = make_sp_model(tmp_path / "sp")
    long = script == LONG
    out = _rehearse(script, tmp_path, model,
                    *(("--rehearse-hidden-size", "64", "--rehearse-seq-length", "64") if long
                      else ()), NUM_NODES=nodes)
    assert layout in out
    assert "32 layers, 32 heads, hidden 64 (run: 4096)" in out
    line = next(line for line in out.splitlines() if line.startswith("parameters "))
    assert line.split()[1:3] == parameters.split(), line


def test_megatron_deepspeeds_llama2_flag_set_is_accepted_as_written(tmp_path):
    """examples_deepspeed/pretrain_llama2_distributed.sh's pretrain_gpt.py flags, values and
    all (a SentencePiece tokenizer file and a DeepSpeed JSON of its own making)."""
    from megatron.config import parse_args
    from megatron.integrations.deepspeed import deepspeed_config_or_exit

    ds = tmp_path / "deepspeed.json"
    ds.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                              "steps_per_print": 1, "zero_optimization": {"stage": 0},
                              "bf16": {"enabled": True}}))
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"")  # only its existence is checked here
    argv = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 "
            "--hidden-size 2048 --ffn-hidden-size 5504 --num-attention-heads 16 "
            "--micro-batch-size 4 --global-batch-size 32 --seq-length 2048 "
            "--max-position-embeddings 2048 --train-iters 250000 "
            f"--save {tmp_path} --load {tmp_path} --data-path 1 {tmp_path}/bookcorpus "
            "--data-impl mmap --tokenizer-type GPTSentencePieceTokenizer "
            f"--tokenizer-model {tokenizer} --split 949,50,1 --distributed-backend nccl "
            "--lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --weight-decay 0.1 --clip-grad 1 "
            "--lr-warmup-iters 2000 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 "
            "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 "
            "--bf16 --no-query-key-layer-scaling --attention-dropout 0 --hidden-dropout 0 "
            "--use-rotary-position-embeddings --untie-embeddings-and-output-weights --swiglu "
            "--normalization rmsnorm --disable-bias-linear --num-key-value-heads 4 "
            f"--zero-stage=0 --deepspeed_config={ds} --deepspeed").split()
    cfg = parse_args(argv, world_size=8)
    m = cfg.model
    assert (m.normalization, m.swiglu, m.query_groups, m.position_embedding_type,
            m.untie_embeddings_and_output_weights, m.add_bias_linear) == (
        "RMSNorm", True, 4, "rope", True, False)
    assert cfg.data.tokenizer_type == "GPTSentencePieceTokenizer"
    assert deepspeed_config_or_exit(cfg)["train_batch_size"] == 32  # the pipeline engine's

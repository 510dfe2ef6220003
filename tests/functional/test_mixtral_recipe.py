"""examples/mixtral/train_mixtral_8x7b_distributed.sh run as users run it: at toy size on the
CPU (CPU_SMOKE=1: tensor 2 x data 2 with expert parallel 2, the recipe's flags) and rehearsed
at its 64-GPU layout (REHEARSE=1: tensor 8 x data 8, expert parallel 8, the all-to-alls
matched), with a SentencePiece tokenizer built here from local text."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.checkpointing import read_tracker
from tests.dist_utils import free_port
from tests.distributed.training_utils import parse_log_lines
from tests.functional.test_pretrain_cli import _printed_argument
from tests.unit.tokenizer.test_llama_tokenizers import _text, make_sp_model

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
MIXTRAL = os.path.join(REPO, "examples", "mixtral", "train_mixtral_8x7b_distributed.sh")


@pytest.fixture(scope="module")
def mixtral_data(tmp_path_factory):
    """A Llama 2-style SentencePiece tokenizer.model (Mixtral's kind) and a small dataset
    preprocessed with it, named as the recipe expects."""
    pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("mixtral")
    model = make_sp_model(folder)
    docs = [p for p in _text().split("\n\n") if p.strip()] * 6
    src = folder / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(src),
         "--output-prefix", str(folder / "mixtral"), "--tokenizer-type", "Llama2Tokenizer",
         "--tokenizer-model", model, "--append-eod", "--workers", "1"],
        capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return folder, model


def _script(tmp_path, model: str, *flags: str, timeout: int = 300, **env):
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), **env,
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(["bash", MIXTRAL, str(tmp_path / "ckpt"), str(tmp_path / "tb"), model,
                           *flags], capture_output=True, text=True, env=run_env, cwd=REPO,
                          timeout=timeout)


@pytest.mark.slow  # 4 training processes (about 15 s alone, more beside other work)
def test_the_mixtral_recipe_trains_at_toy_size(mixtral_data, tmp_path):
    """Two iterations at tensor 2 x data 2 with 8 experts over expert parallel 2 (4 per
    rank), all-to-all, the distributed optimizer: the load-balancing loss is logged and the
    checkpoint (the experts' optimizer state included) is saved."""
    folder, model = mixtral_data
    done = _script(tmp_path, model, CPU_SMOKE="1", DATASET_PATH=str(folder),
                   DATASETCACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = parse_log_lines(done.stdout)
    assert [line["iteration"] for line in lines] == [1, 2]
    assert "load_balancing_loss:" in done.stdout
    printed = {name: _printed_argument(done.stdout, name) for name in (
        "tensor_model_parallel_size", "expert_model_parallel_size", "data_parallel_size",
        "num_experts", "moe_router_topk", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
        "use_distributed_optimizer", "swiglu", "normalization", "num_query_groups",
        "rotary_base", "tokenizer_type")}
    assert printed == {
        "tensor_model_parallel_size": "2", "expert_model_parallel_size": "2",
        "data_parallel_size": "2", "num_experts": "8", "moe_router_topk": "2",
        "moe_aux_loss_coeff": "0.01", "moe_token_dispatcher_type": "alltoall",
        "use_distributed_optimizer": "True", "swiglu": "True", "normalization": "RMSNorm",
        "num_query_groups": "2", "rotary_base": "1000000", "tokenizer_type": "Llama2Tokenizer"}
    assert read_tracker(str(tmp_path / "ckpt")).iteration == 2


def test_the_mixtral_recipe_rehearses_at_64_gpus(mixtral_data, tmp_path):
    """REHEARSE=1 with NUM_NODES=8: the 64-rank launch, shrunk to hidden 64 and sequence 64
    (2 micro-batches instead of 32, --global-batch-size 16 after the tokenizer): the
    first and last rank of the stage run, every all-to-all of the expert groups is matched
    split by split, and the recorded dispatch equals the planner's bytes."""
    _, model = mixtral_data
    done = _script(tmp_path, model, "--rehearse-hidden-size", "64", "--rehearse-seq-length",
                   "64", "--global-batch-size", "16", REHEARSE="1", DATASET_PATH="/nowhere")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert ("tensor 8 x pipeline 1 x data 8 = 64 ranks, sequence parallel, expert parallel 8 "
            "within data (alltoall), distributed optimizer") in out
    assert "32 layers, 32 heads, hidden 64 (run: 4096), sequence 64 (run: 4096), bfloat16" in out
    assert "rehearsal passed:" in out
    check = next(line for line in out.splitlines() if line.startswith("  rank 0 (stage 0, "
                                                                       "tensor 0, data 0, "
                                                                       "expert 0): weights"))
    assert "ep dispatch 1.000" in check and "tp all-reduce 1.000" in check, check
    # The real size's traffic: 32 layers x 256 MiB x 2 micro-batches handed to all-to-alls.
    line = next(line for line in out.splitlines() if line.startswith("  ep dispatch"))
    assert line.split()[2:4] == ["16.00", "GB"], line
    assert not (tmp_path / "ckpt").exists()

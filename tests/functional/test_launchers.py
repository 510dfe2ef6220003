"""Launching as users do, for real, at toy size on the CPU: the GPT-3 175B script and its
throughput variant (CPU_SMOKE=1), DeepSpeed's launcher and engine through the single-node recipe (with
--num_gpus, --num_nodes and a hostfile, run per node with --no_ssh --node_rank as there is no
ssh here), the one-GPU script's single-process emulation, and srun with two tasks that find
rank 0 from the node list alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

from megatron.checkpointing import read_tracker
from megatron.data.dataset_utils import get_train_valid_test_split_
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tests.corpus import build_corpus
from tests.dist_utils import free_port
from tests.distributed.training_utils import parse_log_lines
from tests.functional.test_pretrain_cli import TOY_FLAGS, _printed_argument, _run

BLEND = ("wikipedia_20220301_en_text_document", "openwebtext_Skylion007_text_document")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two small datasets under the two names of the 175B recipe's blend (the same articles,
    in opposite orders), each with documents in the validation share of --split 949,50,1,
    and their tokenizer."""
    folder = tmp_path_factory.mktemp("datasets")
    built = build_corpus(str(folder))
    source = MMapIndexedDataset(built["prefix"])
    documents = [np.array(source[i]) for i in range(len(source))]
    bounds = get_train_valid_test_split_("949,50,1", len(documents))
    assert bounds[2] > bounds[1], bounds  # the validation share is not empty
    for name, order in zip(BLEND, (documents, documents[::-1])):
        builder = MMapIndexedDatasetBuilder(str(folder / f"{name}.bin"), dtype=source.dtype)
        for doc in order:
            builder.add_doc(doc, [len(doc)])
        builder.finalize(str(folder / f"{name}.idx"))
    tok = built["tokenizer_flags"]
    return dict(folder=folder, prefix=built["prefix"], vocab=tok[tok.index("--vocab-file") + 1],
                merges=tok[tok.index("--merge-file") + 1])


def _gpt3(script: str, corpus, tmp_path, **env):
    return _run(["bash", f"examples/gpt3/{script}", tmp_path / "ckpt", tmp_path / "tb",
                 corpus["vocab"], corpus["merges"]], timeout=300, CPU_SMOKE="1",
                DATASET_PATH=str(corpus["folder"]), DATASETCACHE=str(tmp_path / "cache"),
                MASTER_PORT=str(free_port()), **env)


@pytest.mark.slow
def test_gpt3_175b_script_trains_at_toy_size(corpus, tmp_path):
    done = _gpt3("train_gpt3_175b_distributed.sh", corpus, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]
    printed = {name: _printed_argument(done.stdout, name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
        "use_distributed_optimizer", "use_flash_attn", "data_path")}
    assert printed == {
        "tensor_model_parallel_size": "2", "pipeline_model_parallel_size": "2",
        "sequence_parallel": "True", "use_distributed_optimizer": "True",
        "use_flash_attn": "True", "data_path": str(
            ["0.35", str(corpus["folder"] / BLEND[0]), "0.65", str(corpus["folder"] / BLEND[1])])}
    assert read_tracker(str(tmp_path / "ckpt")).iteration == 2
    assert any(name.endswith(".npy") for name in os.listdir(tmp_path / "cache"))


@pytest.mark.slow
def test_gpt3_tgs_script_prints_the_mean_throughput_of_10_iterations(corpus, tmp_path):
    """On the recipe's two-dataset blend, whose validation share holds documents: --eval-iters
    0 builds no validation dataset (an empty one stopped every rank, issue 22 item 2)."""
    # Two ranks (tensor 2) keep the ten iterations short on a 2-core machine.
    done = _gpt3("train_gpt3_175b_distributed_tgs.sh", corpus, tmp_path, GPUS_PER_NODE="2",
                 PP="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = parse_log_lines(done.stdout)
    assert [line["iteration"] for line in lines] == list(range(1, 11))
    tgs = [line["tokens per GPU per second (TGS)"] for line in lines[1:]]
    tflops = [line["TFLOP/s per GPU"] for line in lines[1:]]
    summary = done.stdout[done.stdout.index("throughput over iterations 2-10 (9 logged):"):]
    printed_tgs = float(re.search(r"tokens per GPU per second \(TGS\): ([\d.]+)",
                                  summary).group(1))
    printed_tflops = float(re.search(r"TFLOP/s per GPU: ([\d.]+)", summary).group(1))
    assert printed_tgs == pytest.approx(sum(tgs) / 9, abs=0.06)
    assert printed_tflops == pytest.approx(sum(tflops) / 9, abs=6e-4)
    assert printed_tgs > 0
    assert not (tmp_path / "ckpt").exists()  # a benchmark writes no checkpoint
    assert (tmp_path / "tb" / "tgs.log").read_text() in done.stdout


def _toy_args(corpus, tmp_path) -> list:
    return [tmp_path / "ckpt", corpus["vocab"], corpus["merges"], corpus["prefix"],
            *TOY_FLAGS]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("deepspeed") is None,
                    reason="needs DeepSpeed's launcher (pip install deepspeed)")
def test_deepspeed_launcher_runs_the_single_node_recipe(corpus, tmp_path):
    """Megatron-DeepSpeed's single-node command: DeepSpeed's launcher, its engine with the
    JSON the script writes (ZeRO stage 1 by default), DS_ARGS passed on, and the model's size
    and length set by the usual variables (NUM_LAYERS, HIDDEN_SIZE, ..., TRAIN_ITERS)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    sizes = dict(NUM_LAYERS="1", HIDDEN_SIZE="16", NUM_HEADS="2", SEQ_LENGTH="16",
                 TRAIN_ITERS="2", LOG_INTERVAL="1", EVAL_INTERVAL="2", EVAL_ITERS="1")
    done = _run(["bash", "examples/pretrain_gpt_single_node.sh", tmp_path / "ckpt",
                 corpus["vocab"], corpus["merges"], corpus["prefix"], "--use-cpu", "--split",
                 "90,5,5", "--num-workers", "0"], timeout=300, N_GPUS="2",
                NUM_NODES="1", HOSTFILE=str(hostfile), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), PRECISION="fp32", MICRO_BATCH_SIZE="1",
                GLOBAL_BATCH_SIZE="2", DS_ARGS="--partition-activations", **sizes)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "WORLD INFO DICT: {'localhost': [0, 1]}" in out  # DeepSpeed's launcher said so
    written = json.loads((tmp_path / "ckpt" / "ds_config.json").read_text())
    assert written == {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
                       "steps_per_print": 10, "zero_optimization": {"stage": 1},
                       "wall_clock_breakdown": False}
    # DeepSpeed's engine ran at ZeRO stage 1 (its own config print, and our line).
    assert re.search(r"\[config.py:\d+:print\] +zero_optimization_stage \.+ 1\n", out)
    assert re.search(r"> DeepSpeed engine \S+: ZeRO stage 1, plain model", out)
    assert "----Partition Activations True" in out  # DS_ARGS reached DeepSpeed's recompute
    assert _printed_argument(done.stdout, "data_parallel_size") == "2"
    assert _printed_argument(done.stdout, "recompute_granularity") == "full"
    printed = {name: _printed_argument(done.stdout, name) for name in (
        "num_layers", "hidden_size", "num_attention_heads", "seq_length",
        "max_position_embeddings", "train_iters", "lr_decay_iters", "eval_iters")}
    assert printed == {"num_layers": "1", "hidden_size": "16", "num_attention_heads": "2",
                       "seq_length": "16", "max_position_embeddings": "16", "train_iters": "2",
                       "lr_decay_iters": "2", "eval_iters": "1"}
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step2"


def test_one_gpu_script_emulates_a_distributed_launch(corpus, tmp_path):
    port = str(free_port())
    done = _run(["bash", "examples/pretrain_gpt.sh", *_toy_args(corpus, tmp_path)],
                timeout=180, MASTER_PORT=port, PRECISION="fp32")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]
    assert read_tracker(str(tmp_path / "ckpt")).iteration == 2


TWO_TASK_SRUN = """#!/bin/bash
# srun --ntasks 2 on one node: drop srun's options, start the two tasks with srun's variables.
while [ "${1#-}" != "$1" ]; do shift; done
for id in 0 1; do
    SLURM_PROCID=$id SLURM_LOCALID=$id SLURM_NODEID=0 SLURM_NTASKS=2 "$@" &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
"""


def test_srun_tasks_meet_at_the_first_host_of_the_node_list(corpus, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(TWO_TASK_SRUN)
    (bin_dir / "python").write_text(f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    done = _run(["bash", "examples/slurm/pretrain_gpt_slurm.sh", *_toy_args(corpus, tmp_path),
                 "--global-batch-size", "2"], timeout=300,
                PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=os.getcwd(),
                SLURM_JOB_NODELIST="localhost,ghost[01-07]", SLURM_NTASKS="2", TP="1",
                PRECISION="fp32", MASTER_PORT=str(free_port()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _printed_argument(done.stdout, "data_parallel_size") == "2"
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]

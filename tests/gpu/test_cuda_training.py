"""Training on a GPU (skipped where CUDA is not available).

Runs go through ``python pretrain_gpt.py`` in subprocesses (the test process never joins an
NCCL group), or through ``pretrain()`` inside spawned gloo ranks for the several-ranks-on-one-
GPU layouts. The corpus is real text (tests/corpus.py; carry ../shared/data and point
MEGATRON_TEST_DATA at it on a GPU machine, or let it fall back to Python's documentation).

What is checked:
- one GPU in fp32 (TF32 off) gives the CPU run's losses within 1e-4 for 5 iterations;
- bf16 on one GPU learns and stays near fp32;
- dropout under the RNG tracker repeats on CUDA, and a checkpoint saved on the GPU resumes bit
  for bit there (--deterministic-mode) and loads on the CPU;
- tensor parallel 2 and pipeline parallel 2 as two processes on one GPU (gloo carrying CUDA
  tensors; pipeline exchanges through host memory) equal one process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

import pretrain_gpt
from megatron.checkpointing import read_tracker
from tests.dist_utils import run_distributed
from tests.distributed import training_utils

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ON_GPU = {"--use-cpu": None}  # base_argv keeps runs on the CPU unless told otherwise


def argv(corpus, cache, **overrides) -> list[str]:
    return training_utils.base_argv(corpus, cache, **{
        "--num-layers": 4, "--hidden-size": 64, "--num-attention-heads": 4,
        "--seq-length": 64, "--max-position-embeddings": 64, "--global-batch-size": 8,
        "--train-iters": 5, "--lr": 1e-3, "--min-lr": 1e-4, "--lr-warmup-iters": 1,
        **overrides})


def run_cli(args: list[str]) -> str:
    """``python pretrain_gpt.py ARGS`` as one process; returns its output (exit 0 asserted)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", NVIDIA_TF32_OVERRIDE="0")
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def losses(output: str) -> list[float]:
    return [line["lm loss"] for line in training_utils.parse_log_lines(output)]


def assert_close(got: list[float], expected: list[float], rel: float) -> None:
    assert len(got) == len(expected) > 0
    for i, (a, b) in enumerate(zip(got, expected)):
        assert math.isclose(a, b, rel_tol=rel), (i, got, expected)


def test_fp32_on_one_gpu_matches_the_cpu(corpus, cache):
    gpu = run_cli(argv(corpus, cache, **ON_GPU))
    cpu = run_cli(argv(corpus, cache))
    assert "> compute device: cuda:0, collectives: nccl" in gpu
    assert "> compute device: cpu, collectives: gloo (--use-cpu" in cpu
    assert_close(losses(gpu), losses(cpu), rel=1e-4)
    assert "memory (MB) | allocated:" in gpu and "max reserved:" in gpu


def test_bf16_learns_and_stays_near_fp32(corpus, cache):
    flags = {**ON_GPU, "--train-iters": 30, "--lr": 3e-3}
    fp32 = losses(run_cli(argv(corpus, cache, **flags)))
    bf16 = losses(run_cli(argv(corpus, cache, **flags, **{"--bf16": True})))
    assert bf16[-1] < bf16[0] - 0.5, bf16
    assert_close(bf16[-5:], fp32[-5:], rel=0.03)


def test_dropout_repeats_and_a_gpu_checkpoint_resumes_bit_for_bit(corpus, cache, tmp_path):
    flags = {**ON_GPU, "--train-iters": 10, "--hidden-dropout": 0.1,
             "--attention-dropout": 0.1, "--deterministic-mode": True}
    straight = losses(run_cli(argv(corpus, cache, **flags)))
    assert losses(run_cli(argv(corpus, cache, **flags))) == straight  # same masks, same bits
    no_dropout = {**flags, "--hidden-dropout": 0.0, "--attention-dropout": 0.0}
    assert losses(run_cli(argv(corpus, cache, **no_dropout))) != straight  # dropout is on

    save = str(tmp_path / "ckpt")
    first = losses(run_cli(argv(corpus, cache, **flags, **{
        "--save": save, "--save-interval": 100, "--exit-interval": 5})))
    assert read_tracker(save).iteration == 5
    resumed = losses(run_cli(argv(corpus, cache, **flags, **{"--load": save})))
    assert first + resumed == straight

    # The same checkpoint on the CPU: loads (the tracker's CUDA states are set aside with a
    # warning) and trains on; dropout masks differ there, so the loss is only close.
    on_cpu = run_cli(argv(corpus, cache, **{**flags, "--use-cpu": True, "--load": save,
                                            "--deterministic-mode": None,
                                            "--exit-interval": 7}))
    assert "another device type" in on_cpu
    assert_close(losses(on_cpu), straight[5:7], rel=0.05)


def _train_on_the_gpu(rank: int, world_size: int, args: list[str]) -> list:
    state = pretrain_gpt.main(args)
    return [(h["losses"]["lm loss"], h["grad_norm"]) for h in state.history]


@pytest.mark.parametrize("layout", [
    {"--tensor-model-parallel-size": 2},
    {"--pipeline-model-parallel-size": 2},
])
def test_two_ranks_on_one_gpu_over_gloo_equal_one_process(corpus, cache, layout):
    args = argv(corpus, cache, **ON_GPU)
    one = run_distributed(_train_on_the_gpu, 1, args, timeout=600)[0]
    two = run_distributed(_train_on_the_gpu, 2, argv(corpus, cache, **ON_GPU, **layout),
                          timeout=600)
    assert two[0] == two[1]
    for (loss, norm), (ref_loss, ref_norm) in zip(two[0], one, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5)
        assert math.isclose(norm, ref_norm, rel_tol=1e-4)

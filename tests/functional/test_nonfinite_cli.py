"""pretrain_gpt.py with a learning rate that blows the model up (``--lr 1e10``).

The first update or two are finite (if absurd), then every loss is NaN. The non-finite guard
skips those steps, saves no checkpoint at them, and stops the run with exit status 1 after
--max-consecutive-nonfinite-iterations (10) in a row. Every checkpoint on disk holds only
finite values and the tracker names the last one saved at a finite iteration. Before the
guard the run exited 0 with NaN checkpoints, the latest one among them.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing import list_iterations, read_tracker
from tests.distributed.training_utils import base_argv, build_small_corpus, parse_log_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")))


def _env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _nonfinite_tensors(value, path="") -> list[str]:
    """Paths of the floating-point tensors in a loaded checkpoint that hold NaN/Inf."""
    if isinstance(value, torch.Tensor):
        finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        return [] if finite else [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nonfinite_tensors(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _nonfinite_tensors(v, f"{path}/{i}")]
    if isinstance(value, float) and not math.isfinite(value):
        return [path]
    return []


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exploding_run_stops_nonzero_and_keeps_the_last_finite_checkpoint(
        corpus, tmp_path, precision):
    save = str(tmp_path / "ckpt")
    flags = {"--lr": 1e10, "--train-iters": 20, "--save": save, "--save-interval": 2,
             "--bf16": precision == "bf16"}
    if precision == "bf16":  # about 35x slower on a CPU: the smallest model that still runs
        flags.update({"--num-layers": 1, "--hidden-size": 16, "--num-attention-heads": 2,
                      "--seq-length": 16, "--max-position-embeddings": 16})
    argv = base_argv(corpus, str(tmp_path / "cache"), **flags)
    done = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log[-3000:]

    # Which iterations were finite: their log line has a loss (a skipped one has none).
    lines = parse_log_lines(done.stdout)
    finite = [line["iteration"] for line in lines if "lm loss" in line]
    skipped = [line["iteration"] for line in lines if "lm loss" not in line]
    assert finite and skipped, log[-3000:]
    first_bad = skipped[0]
    assert skipped == list(range(first_bad, first_bad + 10))  # then it stopped
    assert [line["iteration"] for line in lines][-1] == first_bad + 9
    warnings = re.findall(r"WARNING: iteration (\d+): the loss of micro-batch (\d+) "
                          r"\(counted from 0, of 2\) on rank 0 is NaN/Inf; the step was "
                          r"skipped", done.stdout)
    assert [int(it) for it, _ in warnings] == skipped
    # Skipped steps do not advance the learning-rate schedule (Megatron's accounting).
    rates = {line["iteration"]: line["learning rate"] for line in lines}
    assert {rates[it] for it in skipped} == {rates[first_bad - 1]}

    # A clear message naming the flag, and no traceback.
    assert (f"error: 10 iterations in a row ({first_bad}-{first_bad + 9}) had a NaN/Inf loss "
            "or grad norm and were skipped; stopping without saving") in done.stderr
    assert "--max-consecutive-nonfinite-iterations" in done.stderr
    # The way on it advises is one that resumes (tests/functional/test_resume_messages.py).
    assert (f"resume with --load {save} --override-opt_param-scheduler and a lower --lr"
            in done.stderr)
    assert "Traceback" not in log

    # Checkpoints only at finite iterations, the tracker at the last of them, all finite.
    saved = [it for it in finite if it % 2 == 0]
    assert list_iterations(save) == saved and saved
    assert read_tracker(save).iteration == saved[-1]
    for it in saved:
        folder = os.path.join(save, f"iter_{it:07d}")
        for root, _, files in os.walk(folder):
            for name in (f for f in files if f.endswith(".pt")):
                state = torch.load(os.path.join(root, name), weights_only=True)
                assert _nonfinite_tensors(state) == [], (it, name)
    assert not [d for d in os.listdir(save) if ".tmp-" in d]


@pytest.mark.slow
def test_fp16_overflowing_every_step_warns_and_stops_like_the_nan_guard():
    """``--fp16 --loss-scale 1e9``: every step overflows and the static scale cannot back off.
    It used to skip all 30 steps and exit 0; now it warns at each and stops at 10."""
    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "30", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
            "--use-cpu", "--fp16", "--loss-scale", "1e9"]
    done = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    lines = parse_log_lines(done.stdout)
    assert [line["iteration"] for line in lines] == list(range(1, 11))
    assert all(line["number of skipped iterations"] == 1 for line in lines)
    warnings = re.findall(r"WARNING: iteration (\d+): fp16 overflow; the loss scaler skipped "
                          r"the step and cannot back off: its scale is fixed at 1e\+09 "
                          r"\(--loss-scale\)\. (\d+) in a row", done.stdout)
    assert warnings == [(str(i), str(i)) for i in range(1, 11)]
    assert done.stderr.splitlines()[-1].startswith(
        "error: 10 iterations in a row (1-10) overflowed in fp16 and were skipped")
    assert "Drop --loss-scale" in done.stderr and "Traceback" not in done.stderr

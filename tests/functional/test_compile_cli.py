"""``--compile`` and ``--no-gradient-accumulation-fusion`` through ``python pretrain_gpt.py``.

On the CPU torch.compile runs inductor's C++ backend, so the compiled layers are the same
graphs a GPU run traces (only the generated kernels differ): their losses must equal the
eager run's, their checkpoints must load without ``--compile``, and the flag is refused with
``--deepspeed``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

from tests.distributed.training_utils import parse_log_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
        "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--use-cpu",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def _pretrain(*extra: str, expect: int = 0) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == expect, out[-4000:]
    return out


def _curve(out: str) -> list[tuple[float, float]]:
    return [(line["lm loss"], line["grad norm"]) for line in parse_log_lines(out)]


def _assert_close(got, expected, rel):
    assert len(got) == len(expected) > 0
    for (loss, norm), (ref_loss, ref_norm) in zip(got, expected):
        assert math.isclose(loss, ref_loss, rel_tol=rel), (got, expected)
        assert math.isclose(norm, ref_norm, rel_tol=10 * rel), (got, expected)


def test_compiled_layers_train_as_eager_ones_and_save_plain_checkpoints(tmp_path):
    eager = _curve(_pretrain())
    save = str(tmp_path / "ckpt")
    compiled = _pretrain("--compile", "--save", save, "--save-interval", "100",
                         "--exit-interval", "4")
    assert "> --compile: 2 transformer layers on this rank go through torch.compile" in compiled
    _assert_close(_curve(compiled), eager[:4], rel=1e-5)
    # The compiled layers keep their parameter names: an eager run resumes the checkpoint.
    resumed = _pretrain("--load", save)
    assert [line["iteration"] for line in parse_log_lines(resumed)] == [5, 6]
    _assert_close(_curve(resumed), eager[4:], rel=1e-5)


def test_gradient_accumulation_fusion_off_gives_the_same_training():
    """fp32: the fused path adds each weight gradient inside its matmul, the unfused one adds
    autograd's gradient in the wrapper's hook; same sums up to rounding order."""
    _assert_close(_curve(_pretrain("--no-gradient-accumulation-fusion")), _curve(_pretrain()),
                  rel=1e-5)


def test_compile_is_refused_with_deepspeed():
    out = _pretrain("--compile", "--deepspeed", expect=2)
    assert "--compile is not wired into DeepSpeed's engine" in out

"""benchmarks/deepspeed_overhead.py end to end at the toy shape: both sides train, the report
gives each side's tokens/s, their ratio, and losses that agree (same model, same data)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed")


def test_native_and_zero1_throughput_and_ratio_are_reported():
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/deepspeed_overhead.py", "--shape", "tiny",
                           "--rounds", "1", "--iters", "2", "--warmup", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    native = float(re.search(r"native +([\d.]+) +[\d.]+ +[\d.]+\n", out).group(1))
    ds = float(re.search(r"DeepSpeed ZeRO-1 +([\d.]+) +[\d.]+ +[\d.]+\n", out).group(1))
    ratio = float(re.search(r"DeepSpeed / native: median of rounds ([\d.]+)", out).group(1))
    assert native > 0 and ds > 0
    assert ratio == pytest.approx(ds / native, abs=1e-3)
    loss_diff = float(re.search(r"largest relative loss difference (\S+)", out).group(1))
    assert loss_diff <= 1e-5  # DeepSpeed's engine trained the same model on the same data


def test_bad_shape_for_the_device_is_refused():
    done = subprocess.run([sys.executable, "benchmarks/deepspeed_overhead.py", "--device", "cuda",
                           "--shape", "tiny"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "--shape tiny: not a cuda shape" in done.stderr

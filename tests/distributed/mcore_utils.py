"""Real megatron-core for the torch_dist tests: where tests/mcore_driver.py finds it, the skip
when it is absent, and the driver's run (isolated: megatron-core's package is also named
``megatron``; see the driver's docstring)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE_DIR = os.environ.get("MEGATRON_CORE_DIR") or os.path.join(REPO, ".test-deps",
                                                                  "megatron-core")
HAVE_MCORE = any(importlib.metadata.distributions(name="megatron-core", path=[MCORE_DIR]))
NEEDS_MCORE = pytest.mark.skipif(
    not HAVE_MCORE, reason=f"megatron-core is not in {MCORE_DIR} (README's test command "
    f"installs it there: pip install --no-deps --upgrade --target {MCORE_DIR} "
    "megatron-core==0.16.1)")


def run_mcore_driver(out: str, *args: str, script: str = "mcore_driver.py") -> None:
    """``python -I tests/<script> *args`` in ``out`` (no PYTHONPATH: its ``megatron`` is
    megatron-core's); fails the test with the driver's output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", os.path.join(REPO, "tests", script),
                           *args], cwd=out, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

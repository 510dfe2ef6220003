"""Checkpoints written before the package was restructured (tests/fixtures/checkpoints_v1,
one per format: torch, torch_dist, DeepSpeed's) load after it: the same logits, and a run
resumed from each gives the losses the original run went on with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.conversion.full import read_checkpoint
from megatron.model.gpt_model import GPTModel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints_v1")
EXPECTED = json.load(open(os.path.join(FIXTURES, "expected.json")))
FORMATS = list(EXPECTED["formats"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_saved_model_gives_its_logits(fmt):
    full = read_checkpoint(os.path.join(FIXTURES, fmt), optimizer=False)
    model = GPTModel(full.model_config()).eval()
    model.load_state_dict(full.model)
    ids = torch.arange(32).reshape(2, 16) * 3 % 127
    with torch.no_grad():
        logits = model(ids)[..., :127]
    torch.testing.assert_close(logits, torch.tensor(EXPECTED["logits"][fmt]), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_resumed_from_it_goes_on_as_the_original(fmt, tmp_path):
    load = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES, fmt), load)  # a resumed run writes beside it
    history = tmp_path / "history"
    history.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_TEST_HISTORY": str(history)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "distributed", "pretrain_recorded.py"),
         *EXPECTED["flags"], *EXPECTED["formats"][fmt], "--load", str(load)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.load(open(history / "rank0.json"))
    assert [h["iteration"] for h in resumed] == [3, 4]
    assert [h["losses"]["lm loss"] for h in resumed] == EXPECTED["losses"][fmt][2:]

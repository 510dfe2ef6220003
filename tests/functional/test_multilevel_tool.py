"""tools/multilevel.py on checkpoint folders, and the V-cycle example end to end (issue 15)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from megatron.checkpointing import read_manifest, read_tracker
from megatron.config import ModelConfig, to_dict
from megatron.model.gpt_model import GPTModel
from megatron.multilevel import coalesce, decoalesce
from tests.distributed.training_utils import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tool():
    return load_tool("multilevel")


def _large(tool, folder) -> tuple[dict, ModelConfig]:
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=100, make_vocab_size_divisible_by=8)
    torch.manual_seed(0)
    state = GPTModel(config).state_dict()
    run_config = {"model": to_dict(config), "training": {"train_iters": 10}}
    tool.write_full_checkpoint(str(folder), state, config, run_config, {})
    return state, config


def _read(tool, folder):
    return tool.read_full_checkpoint(str(folder), "--load")


def test_coalesce_decoalesce_interpolate_on_folders(tool, tmp_path, capsys):
    state, config = _large(tool, tmp_path / "large")
    assert tool.main(["coalesce", "--load", str(tmp_path / "large"), "--pairing", "halves",
                      "--save", str(tmp_path / "small")]) == 0
    assert "--num-layers 2 --hidden-size 16 --num-attention-heads 2" in capsys.readouterr().out
    small = _read(tool, tmp_path / "small")
    expected, small_config = coalesce(state, config, pairing="halves")
    assert to_dict(small.config) == to_dict(small_config)
    assert small.record == {"width": True, "depth": True, "pairing": "halves"}
    assert all(torch.equal(small.model[k], expected[k]) for k in expected)
    assert read_tracker(str(tmp_path / "small")).release
    assert read_manifest(str(tmp_path / "small" / "release"))["config"]["training"] == {
        "train_iters": 10}

    # decoalesce follows the small checkpoint's record (halves), not the flag's default
    assert tool.main(["decoalesce", "--load", str(tmp_path / "small"),
                      "--save", str(tmp_path / "back")]) == 0
    back = _read(tool, tmp_path / "back")
    expected_back, _ = decoalesce(small.model, small.config, pairing="halves")
    assert to_dict(back.config) == to_dict(config)
    assert all(torch.equal(back.model[k], expected_back[k]) for k in state)

    for alpha, ends in ((0.0, state), (1.0, expected_back)):
        out = tmp_path / f"interp{alpha}"
        assert tool.main(["interpolate", "--load", str(tmp_path / "large"), "--load-small",
                          str(tmp_path / "small"), "--alpha", str(alpha),
                          "--save", str(out)]) == 0
        got = _read(tool, out)
        assert all(torch.equal(got.model[k], ends[k]) for k in state)


def test_bad_input_is_named(tool, tmp_path, capsys):
    _large(tool, tmp_path / "large")
    assert tool.main(["interpolate", "--load", str(tmp_path / "large"), "--load-small",
                      str(tmp_path / "large"), "--alpha", "0.5",
                      "--save", str(tmp_path / "x")]) == 1
    assert "de-coalesces to --num-layers 8" in capsys.readouterr().err
    assert tool.main(["coalesce", "--load", str(tmp_path / "nothing"),
                      "--save", str(tmp_path / "y")]) == 1
    assert "--load" in capsys.readouterr().err
    # a tensor-parallel checkpoint is refused with its layout named
    tp2 = tmp_path / "tp2"
    for rank in ("mp_rank_00", "mp_rank_01"):
        (tp2 / "iter_0000005" / rank).mkdir(parents=True)
    (tp2 / "latest_checkpointed_iteration.txt").write_text("5")
    assert tool.main(["coalesce", "--load", str(tp2), "--save", str(tmp_path / "z")]) == 1
    assert "tensor-model-parallel size 2" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_vcycle_example_runs_at_toy_size(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OUT_DIR=str(tmp_path), LARGE1_ITERS="2", SMALL_ITERS="2", LARGE2_ITERS="2",
               EVAL_ITERS="1", GLOBAL_BATCH="4", MICRO_BATCH="4", OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "examples/multilevel/multilevel_pretrain.sh"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = re.findall(r"(v-cycle|plain)\s+wall time\s+([\d.]+) s\s+final validation loss "
                      r"([\d.E+-]+)", done.stdout)
    assert [r[0] for r in rows] == ["v-cycle", "plain"], done.stdout
    assert all(0 < float(loss) < 20 for _, _, loss in rows)
    small_log = (tmp_path / "logs" / "small.log").read_text()
    assert "restored: model" in small_log  # the small run started from the coalesced weights
    assert read_tracker(str(tmp_path / "ckpt" / "large2")).iteration == 2

"""tools/multilevel.py on checkpoint folders, and the V-cycle example end to end (issue 15)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from megatron.checkpointing import CheckpointError, read_manifest, read_tracker
from megatron.config import ModelConfig, to_dict
from megatron.conversion import FullCheckpoint, load_full_checkpoint, save_full_checkpoint
from megatron.model.gpt_model import GPTModel
from megatron.research.multilevel import coalesce, decoalesce
from tests.distributed.training_utils import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tool():
    return load_tool("multilevel")


def _large(tool, folder, tp: int = 1, pp: int = 1, optimizer=None, num_layers: int = 4,
           layers_per_virtual_stage=None) -> tuple[dict, ModelConfig]:
    """A random model saved at iteration 10 at (tp, pp[, virtual]), with ``optimizer`` (the
    full form) as a distributed optimizer's state when given."""
    config = ModelConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=100, make_vocab_size_divisible_by=8)
    torch.manual_seed(0)
    state = GPTModel(config).state_dict()
    full = FullCheckpoint(config={"model": to_dict(config), "training": {"train_iters": 10}},
                          model=state, optimizer=optimizer, iteration=10,
                          distributed_optimizer=optimizer is not None)
    save_full_checkpoint(full, str(folder), tp, pp,
                         num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage)
    return state, config


def _read(tool, folder):
    return tool.read_operand(str(folder), "--load")


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
    # a target layout the coalesced model does not divide over is named; nothing is written
    assert tool.main(["coalesce", "--load", str(tmp_path / "large"), "--save",
                      str(tmp_path / "z"), "--target-tensor-parallel-size", "4"]) == 1
    assert "cannot save at tensor-parallel size 4" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_an_interleaved_checkpoint_coalesces_as_its_tp1_copy(tool, tmp_path):
    """6 layers over 3 stages of 2 virtual chunks (chunk k of stage p holds layer 3k + p)
    coalesce as the same model saved at tp 1; the output keeps 3 stages, not interleaved."""
    _large(tool, tmp_path / "tp1", num_layers=6)
    _large(tool, tmp_path / "vp", 1, 3, num_layers=6, layers_per_virtual_stage=1)
    for name in ("tp1", "vp"):
        assert tool.main(["coalesce", "--load", str(tmp_path / name),
                          "--save", str(tmp_path / f"small-{name}")]) == 0
    got = load_full_checkpoint(str(tmp_path / "small-vp"))
    want = load_full_checkpoint(str(tmp_path / "small-tp1"))
    assert got.config["model"]["num_layers"] == 3
    layout = read_manifest(str(tmp_path / "small-vp" / "release"))["parallel_layout"]
    assert (layout["pipeline_model_parallel_size"], layout["num_model_chunks"]) == (3, 1)
    assert all(torch.equal(got.model[k], want.model[k]) for k in want.model)


def _adam_state(state: dict) -> dict:
    torch.manual_seed(1)
    return {"param_groups": [{"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0},
                             {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0}], "step": 3.0,
            "param_state": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
                            for k, v in state.items()}, "grad_scaler": None}


def test_coalescing_a_tp2_pp2_checkpoint_equals_coalescing_its_tp1_reshard(tool, tmp_path,
                                                                          capsys):
    """A tp2 x pp2 checkpoint (with a distributed optimizer's state) coalesces to the model
    its tp1/pp1 reshard coalesces to, saved by default at tp2 x pp2, optimizer state reset."""
    state, _ = _large(tool, tmp_path / "tp1")
    _large(tool, tmp_path / "tp2pp2", 2, 2, optimizer=_adam_state(state))
    sharded = load_full_checkpoint(str(tmp_path / "tp2pp2"))
    assert sharded.distributed_optimizer and sharded.optimizer is not None
    reshard = tmp_path / "reshard"
    save_full_checkpoint(sharded, str(reshard), 1, 1)
    for name, source in (("from-tp2pp2", "tp2pp2"), ("from-reshard", "reshard")):
        assert tool.main(["coalesce", "--load", str(tmp_path / source),
                          "--save", str(tmp_path / name)]) == 0
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in \
        capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "from-tp2pp2" / "release")) == [
        "manifest.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
        "mp_rank_01_001"]
    got = load_full_checkpoint(str(tmp_path / "from-tp2pp2"))
    want = load_full_checkpoint(str(tmp_path / "from-reshard"))
    assert got.optimizer is None and got.release and got.iteration == 0
    assert got.model.keys() == want.model.keys()
    assert all(torch.equal(got.model[k], want.model[k]) for k in want.model)
    assert got.extra == want.extra == {"multilevel": {"width": True, "depth": True,
                                                      "pairing": "adjacent"}}
    assert got.config["model"]["hidden_size"] == 16
    # and the tp1 source coalesces to the same numbers (the reshard lost nothing)
    assert tool.main(["coalesce", "--load", str(tmp_path / "tp1"), "--save",
                      str(tmp_path / "from-tp1")]) == 0
    plain = load_full_checkpoint(str(tmp_path / "from-tp1"))
    assert all(torch.equal(plain.model[k], want.model[k]) for k in want.model)
    # the optimizer state is not even read: a damaged distrib_optim.pt does not stop it
    (tmp_path / "tp2pp2" / "iter_0000010" / "mp_rank_01_001" / "distrib_optim.pt").write_bytes(
        b"damaged")
    with pytest.raises(CheckpointError):  # a reader of the optimizer state would fail
        load_full_checkpoint(str(tmp_path / "tp2pp2"))
    assert tool.main(["coalesce", "--load", str(tmp_path / "tp2pp2"),
                      "--save", str(tmp_path / "again")]) == 0
    # de-coalescing writes the small checkpoint's layout unless told
    assert tool.main(["decoalesce", "--load", str(tmp_path / "from-tp2pp2"), "--save",
                      str(tmp_path / "back"), "--target-pipeline-parallel-size", "1"]) == 0
    assert sorted(os.listdir(tmp_path / "back" / "release")) == [
        "manifest.json", "mp_rank_00", "mp_rank_01"]


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

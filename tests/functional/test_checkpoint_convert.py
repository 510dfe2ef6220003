"""tools/checkpoint/convert.py: HF GPT-2 <-> ours at any layout, and resharding ours.

A tiny random GPT2LMHeadModel saved with save_pretrained is the "HF model". Its vocabulary
(1000) is padded differently at each tensor-parallel size (--make-vocab-size-divisible-by 8:
1000 at tp 1, 1008 at tp 2, 1024 at tp 4), so the chain also re-pads. Logits of our model at a
layout are computed by real gloo ranks running that layout's stages from the converted files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron.checkpointing import read_manifest, read_tracker
from megatron.conversion import load_full_checkpoint, model_config_from_dict
from megatron.core import parallel_state
from megatron.model.gpt_model import GPTModel
from megatron.model.placement import pipeline_chunks
from tests.dist_utils import run_distributed
from tools import checkpoint_util
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 1000, 32


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(path)
    (path / "vocab.json").write_text(json.dumps({"a": 0}))  # tokenizer files to carry along
    (path / "merges.txt").write_text("#version: 0.2\n")
    return str(path), model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _convert(*args: str, tp: int = 1, pp: int = 1, tool=convert) -> None:
    argv = ["--model-type", "GPT", *args, "--target-tensor-parallel-size", str(tp),
            "--target-pipeline-parallel-size", str(pp), "--make-vocab-size-divisible-by", "8"]
    assert tool.main(argv) == 0


def _tp1_logits(folder: str) -> torch.Tensor:
    full = load_full_checkpoint(folder)
    model = GPTModel(full.model_config()).eval()
    model.load_state_dict(full.model)
    with torch.no_grad():
        return model(_ids())[..., :VOCAB]


def _assert_same_hf(original, folder: str) -> None:
    """``folder`` loads in GPT2LMHeadModel with exactly the original's keys and values."""
    again = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    want, got = original.state_dict(), again.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, original(_ids()).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_hf_to_tp1_to_hf(hf_model, tmp_path, weights):
    path, hf = hf_model
    if weights == "bin":  # the same weights as pytorch_model.bin (torch.save of the tensors)
        from safetensors.torch import load_file

        copy = tmp_path / "bin"
        shutil.copytree(path, copy)
        torch.save(load_file(copy / "model.safetensors"), copy / "pytorch_model.bin")
        os.remove(copy / "model.safetensors")
        path = str(copy)
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    _convert("--loader", "hf", "--saver", "megatron", "--load-dir", path, "--save-dir", ours)
    assert read_tracker(ours).release
    with torch.no_grad():
        torch.testing.assert_close(_tp1_logits(ours), hf(_ids()).logits, rtol=0, atol=1e-5)
    _convert("--loader", "megatron", "--saver", "hf", "--load-dir", ours, "--save-dir", back,
             tool=checkpoint_util)
    _assert_same_hf(hf, back)


def _stage_output(folder: str, tp: int, pp: int, ids: torch.Tensor):
    """This rank's stage of the checkpoint in ``folder`` run on ``ids``; the last stage's
    tensor rank 0 returns the logits ``[b, s, VOCAB]`` (gathered over tp), others None."""
    tracker = read_tracker(folder)
    iter_dir = os.path.join(folder, "release" if tracker.release else
                            f"iter_{tracker.iteration:07d}")
    stored = read_manifest(iter_dir)["config"]
    config = dataclasses.replace(model_config_from_dict(stored["model"], tp),
                                 perform_initialization=False)
    t = parallel_state.get_tensor_model_parallel_rank()
    p = parallel_state.get_pipeline_model_parallel_rank()
    chunk = pipeline_chunks(config.num_layers, pp)[p][0]
    model = GPTModel(config, pre_process=chunk.pre_process, post_process=chunk.post_process,
                     first_layer=chunk.first_layer, num_layers=chunk.num_layers,
                     parallel_output=False).eval()
    rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
    state = torch.load(os.path.join(iter_dir, rank_dir, "model_optim_rng.pt"), weights_only=True)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        if chunk.pre_process:
            out = model(ids)
        else:
            hidden = torch.empty(ids.size(1), ids.size(0), config.hidden_size)
            dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
            out = model(None)
        if not chunk.post_process:
            dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    return out[..., :VOCAB] if t == 0 else None


def _logits_at_layouts(rank, world_size, jobs, ids):
    results = []
    for folder, tp, pp in jobs:
        parallel_state.initialize_model_parallel(tp, pp)
        try:
            results.append(_stage_output(folder, tp, pp, ids))
        finally:
            parallel_state.destroy_model_parallel()
    return results


def test_hf_tp2pp2_reshard_tp1_tp4_and_back_to_hf(hf_model, tmp_path):
    """HF -> ours tp2 x pp2 -> tp1 pp1 -> tp4 pp1 -> HF: every layout's logits equal the HF
    model's within 1e-5 and the HF state dict comes back key for key, value for value."""
    path, hf = hf_model
    tp2pp2, tp1, tp4, back = (str(tmp_path / n) for n in ("tp2pp2", "tp1", "tp4", "back"))
    _convert("--loader", "hf", "--saver", "megatron", "--load-dir", path, "--save-dir", tp2pp2,
             tp=2, pp=2)
    _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", tp2pp2,
             "--save-dir", tp1)
    _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", tp1,
             "--save-dir", tp4, tp=4, tool=checkpoint_util)
    _convert("--loader", "megatron", "--saver", "hf", "--load-dir", tp4, "--save-dir", back)
    assert sorted(os.listdir(os.path.join(tp2pp2, "release"))) == [
        "manifest.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    with torch.no_grad():
        expected = hf(_ids()).logits
    torch.testing.assert_close(_tp1_logits(tp1), expected, rtol=0, atol=1e-5)
    results = run_distributed(_logits_at_layouts, 4, [(tp2pp2, 2, 2), (tp4, 4, 1)], _ids())
    at_tp2pp2, at_tp4 = results[2][0], results[0][1]  # tensor rank 0 of each last stage
    for logits in (at_tp2pp2, at_tp4):
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    _assert_same_hf(hf, back)
    assert sorted(f for f in os.listdir(back) if not f.startswith("generation")) == [
        "config.json", "merges.txt", "model.safetensors", "vocab.json"]


def test_bad_arguments_are_named(hf_model, tmp_path, capsys):
    path, _ = hf_model
    cases = [
        (["--loader", "deepspeed", "--load-dir", path], "holds no 'latest' file"),
        (["--loader", "megatron", "--load-dir", path],
         "holds no latest_checkpointed_iteration.txt: it looks like a Hugging Face model: use "
         "--loader hf"),
        (["--loader", "hf", "--load-dir", str(tmp_path / "none")], "is not a folder"),
        (["--loader", "hf", "--load-dir", path, "--target-tensor-parallel-size", "3"],
         "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"),
        (["--loader", "hf", "--saver", "hf", "--load-dir", path,
          "--target-tensor-parallel-size", "2"], "--saver hf writes one unsharded model"),
        (["--loader", "hf", "--saver", "core", "--load-dir", path,
          "--target-distributed-optimizer", "yes"],
         "--saver core writes torch_dist, which every layout reads: drop"),
        (["--loader", "hf", "--saver", "hf", "--load-dir", path, "--vocab-file",
          str(tmp_path / "v.json")], "--vocab-file"),
    ]
    for args, words in cases:
        argv = ["--model-type", "GPT", "--save-dir", str(tmp_path / "out"), *args]
        assert convert.main(argv) == 1, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err, (args, err)
    assert not (tmp_path / "out").exists()


def test_command_line_runs_as_a_script(hf_model, tmp_path):
    """The script itself, from another folder: Megatron-LM's command line as users type it."""
    path, _ = hf_model
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, os.path.join(repo, "tools", "checkpoint", "convert.py"), "--model-type",
         "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", path, "--save-dir",
         str(tmp_path / "ckpt"), "--target-pipeline-parallel-size", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "wrote model at tp=1, pp=2" in done.stdout and "--finetune" in done.stdout
    assert read_tracker(str(tmp_path / "ckpt")).release

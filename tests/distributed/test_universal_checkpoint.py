"""DeepSpeed's universal checkpoints (Megatron-DeepSpeed's way of resharding), end to end.

Our --deepspeed engine trains 5 iterations, saving at iteration 3, as four sources: the plain
model at tensor parallel 2 x data parallel 2 with ZeRO-1 and with ZeRO-2, the pipeline engine
at tp 2 x pp 2 (ZeRO-1; its own parameter names, one file per layer) and ZeRO-3 at dp 4 (its
conversion stores each tensor flat). DeepSpeed's own ``ds_to_universal.py`` (the installed
package's, run as a subprocess; no stand-in was needed on CPU) turns each global_step3 into
global_step3_universal and writes latest_universal beside it. Training resumed from those
folders at other layouts continues the uninterrupted run: iterations 4 and 5 (losses and
grad norms) and the validation loss within 1e-5 relative (principle 2), so the weights,
Adam's moments, the step, the LR schedule and the data position all came across:

- the built-in engine at tp 1 x pp 2 x dp 2 (``--load SAVE --universal-checkpoint``, as
  Megatron-DeepSpeed users type it), at dp 4 with the distributed optimizer (``--load`` of
  the universal folder itself), at tp 4 from the pipeline engine's folder and at tp 2 from
  ZeRO-3's;
- DeepSpeed's engine reading it itself (``checkpoint.load_universal``, as Megatron-DeepSpeed's
  flag sets): ZeRO-1 at dp 4, ZeRO-2 at tp 4 (one head per rank), and the pipeline engine
  (named otherwise than the plain model that saved) at pp 2 x dp 2;
- DeepSpeed's engine at ZeRO stage 0, whose bare optimizer DeepSpeed cannot fill: ours does.

A ZeRO-3 folder given to DeepSpeed's ZeRO-1 engine, and a copy missing one file, stop with one
line saying why. All of it is one 4-rank ``deepspeed`` launch (tests/distributed/
deepspeed_driver.py runs the trainings, and the conversions on rank 0, one after the other).
The vocabulary (128 tokens, --make-vocab-size-divisible-by 32) needs no padding at any of
these sizes: the universal format keeps no padding rows (ds_to_universal.py drops them), so
a padded run resumes with those rows at zero and its loss moves by their share of the
softmax. ``tools/checkpoint/convert.py --loader universal`` and damaged folders are tested
from the same folders.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.formats.deepspeed.universal import read_universal
from megatron.checkpointing.formats.deepspeed.universal_folder import UniversalFolder
from megatron.conversion import load_full_checkpoint
from tests.distributed.test_deepspeed_engine import argv, assert_same, launch
from tests.distributed.training_utils import LLAMA_FLAGS
from tools.checkpoint import convert

REPO = Path(__file__).resolve().parents[2]
# Slow (the launch takes about 40 s on 2 busy cores): it is the one test that runs
# DeepSpeed's own converter on our checkpoints, four sources and eight resumes in one launch.
pytestmark = [pytest.mark.skipif(shutil.which("deepspeed") is None,
                                 reason="the deepspeed launcher is not installed"),
              pytest.mark.slow]
# No padding at tp 1, 2 or 4 (NullTokenizer: 127 ids and the end-of-document token).
UNPADDED = {"--vocab-size": 127, "--make-vocab-size-divisible-by": 32}
SAVED_AT = 3


def _ds_to_universal() -> str:
    """The installed DeepSpeed's own converter script."""
    spec = importlib.util.find_spec("deepspeed")
    return os.path.join(os.path.dirname(spec.origin), "checkpoint", "ds_to_universal.py")


def _convert_command(save: Path) -> list[str]:
    # One worker each: its process pools would only add start-up time for a tiny model.
    return [sys.executable, _ds_to_universal(), "--input_folder",
            str(save / f"global_step{SAVED_AT}"), "--output_folder",
            str(save / f"global_step{SAVED_AT}_universal"), "--num_extract_workers", "1",
            "--num_merge_workers", "1"]


def _run(**flags) -> list[str]:
    return argv(**UNPADDED, **flags)


def _ds(stage: int, **flags) -> list[str]:
    return _run(**{"--deepspeed": True, "--no-pipeline-parallel": True, "--zero-stage": stage,
                   **flags})


@pytest.fixture(scope="module")
def universal_launch(tmp_path_factory):
    """One 4-rank launch: the ZeRO-1 and ZeRO-2 sources (tp 2 x dp 2), the conversions,
    then the resumed runs; returns (results, log, folder)."""
    tmp = tmp_path_factory.mktemp("universal")
    z1, z2, z3, pipe, llama = tmp / "z1", tmp / "z2", tmp / "z3", tmp / "pipe", tmp / "llama"
    saving = {"--save-interval": SAVED_AT, "--tensor-model-parallel-size": 2}
    universal_z2 = z2 / f"global_step{SAVED_AT}_universal"
    damaged = tmp / "damaged"
    runs = {
        "z1_source": _ds(1, **saving, **{"--save": z1}),
        "z2_source": _ds(2, **saving, **{"--save": z2}),
        # DeepSpeed's pipeline engine (its own parameter names, one file per layer) at
        # tp 2 x pp 2.
        "pipe_source": _run(**saving, **{"--deepspeed": True, "--zero-stage": 1, "--save": pipe,
                                         "--pipeline-model-parallel-size": 2}),
        "z3_source": _ds(3, **{"--save-interval": SAVED_AT, "--save": z3}),
        "convert": {"commands": [
            _convert_command(z1), _convert_command(z2), _convert_command(pipe),
            _convert_command(z3),
            # A copy missing one parameter's Adam moment, for --deepspeed to refuse.
            ["cp", "-r", str(universal_z2), str(damaged)],
            ["rm", str(damaged / "zero" / "encoder.layers.1.mlp.dense_4h_to_h.weight"
                       / "exp_avg_sq.pt")]]},
        # The built-in engine, --load SAVE --universal-checkpoint (latest_universal).
        "native_pp2": _run(**{"--pipeline-model-parallel-size": 2, "--load": z1,
                              "--universal-checkpoint": True}),
        # The universal folder itself, into the distributed optimizer at dp 4.
        "native_dp4_distributed": _run(**{"--use-distributed-optimizer": True,
                                          "--load": universal_z2}),
        # DeepSpeed's engine reads it (ZeRO-1/2), at layouts other than the source's.
        "ds_z1_dp4": _ds(1, **{"--load": z2, "--universal-checkpoint": True}),
        "ds_z2_tp4": _ds(2, **{"--tensor-model-parallel-size": 4, "--load": z1,
                               "--universal-checkpoint": True}),
        "ds_pipe_pp2": _run(**{"--deepspeed": True, "--zero-stage": 1,
                               "--pipeline-model-parallel-size": 2, "--load": z1,
                               "--universal-checkpoint": True}),
        "ds_z0_dp4": _ds(0, **{"--load": z2, "--universal-checkpoint": True}),
        # ZeRO-3's folder (each tensor flat, ZeRO-3's model-state files) into the built-in
        # engine; DeepSpeed's ZeRO-1 engine does not read it.
        "native_from_z3": _run(**{"--tensor-model-parallel-size": 2, "--load": z3,
                                  "--universal-checkpoint": True}),
        "ds_z1_from_z3": {"argv": _ds(1, **{"--load": z3, "--universal-checkpoint": True}),
                          "expect_error": True},
        "native_from_pipe": _run(**{"--tensor-model-parallel-size": 4, "--load": pipe,
                                    "--universal-checkpoint": True}),
        "ds_damaged": {"argv": _ds(1, **{"--load": damaged}), "expect_error": True},
        # The Llama family from the pipeline engine at tp 2 x pp 2 (untied LM head, SwiGLU's
        # [gate_r; up_r] merged as two parts), resumed by the built-in engine at tp 1 x pp 2
        # and by DeepSpeed's plain engine at dp 4.
        "llama_source": _run(**LLAMA_FLAGS, **saving, **{
            "--deepspeed": True, "--zero-stage": 1, "--save": llama,
            "--pipeline-model-parallel-size": 2}),
        "convert_llama": {"commands": [_convert_command(llama)]},
        "llama_native_pp2": _run(**LLAMA_FLAGS, **{"--pipeline-model-parallel-size": 2,
                                                   "--load": llama,
                                                   "--universal-checkpoint": True}),
        "llama_ds_z1_dp4": _ds(1, **LLAMA_FLAGS, **{"--load": llama,
                                                    "--universal-checkpoint": True}),
    }
    results, log = launch(4, runs, tmp)
    return results, log, tmp


def test_ds_to_universal_folders_resume_at_other_layouts(universal_launch):
    results, log, tmp = universal_launch
    # Each parameter under the engine's name: the plain model's are ours, the pipeline
    # module's its own.
    names = {"z1": "encoder.layers.0", "z2": "encoder.layers.0", "pipe": "1.layers.0",
             "z3": "encoder.layers.0"}
    for source, layer in names.items():
        folder = tmp / source / f"global_step{SAVED_AT}_universal"
        assert (tmp / source / "latest_universal").read_text().strip() == folder.name
        assert (folder / "zero" / f"{layer}.self_attention.dense.weight" / "exp_avg.pt").is_file()
    for source in ("z2_source", "z3_source", "pipe_source"):  # the sources agree
        assert_same(results[source], results["z1_source"])
    want = {"train": results["z1_source"]["train"][SAVED_AT:],
            "valid": results["z1_source"]["valid"]}
    resumed = ("native_pp2", "native_dp4_distributed", "ds_z1_dp4", "ds_z2_tp4",
               "ds_pipe_pp2", "ds_z0_dp4", "native_from_pipe", "native_from_z3")
    for run in resumed:
        got = results[run]
        assert [t[0] for t in got["train"]] == [4, 5], run
        if run == "ds_z0_dp4":  # DeepSpeed's engine reports no grad norm at stage 0
            assert [t[2] for t in got["train"]] == [None, None]
            got = {**got, "train": [[i, loss, norm] for (i, loss, _), (_, _, norm)
                                    in zip(got["train"], want["train"])]}
        assert_same(got, want)
    llama = {"train": results["llama_source"]["train"][SAVED_AT:],
             "valid": results["llama_source"]["valid"]}
    assert results["llama_source"]["train"] != results["z1_source"]["train"]
    for run in ("llama_native_pp2", "llama_ds_z1_dp4"):
        assert [t[0] for t in results[run]["train"]] == [4, 5], run
        assert_same(results[run], llama)
    # Who loaded it: the built-in engine says what starts anew; DeepSpeed's engine read the
    # optimizer state itself where it could, ours filled stage 0's.
    assert "loaded universal checkpoint" in log
    assert log.count("by DeepSpeed's engine at iteration 3") == 4
    assert log.count("into the engine's model at iteration 3") == 1
    # The damaged copy: one line naming the missing file, on every rank (before DeepSpeed
    # read anything).
    error = results["ds_z1_from_z3"]["error"]
    assert error.startswith("CheckpointError: ") and "converted from a ZeRO-3 checkpoint, " \
        "which DeepSpeed's engine at ZeRO stage 1 does not read: load it without --deepspeed" \
        in error, error
    error = results["ds_damaged"]["error"]
    assert error.startswith("CheckpointError: universal checkpoint file ")
    assert error.endswith("damaged/zero/encoder.layers.1.mlp.dense_4h_to_h.weight/"
                          "exp_avg_sq.pt does not exist"), error


def test_convert_loader_universal(universal_launch, tmp_path):
    """``convert.py --loader universal`` (the save folder or the universal folder) with the
    megatron saver at tp 2 x pp 2 and the torch_dist one: the weights, moments, step,
    schedule and counters of the universal folder; the megatron output equals reading the
    universal folder directly."""
    _, _, tmp = universal_launch
    universal = UniversalFolder(str(tmp / "z1" / f"global_step{SAVED_AT}_universal"), "")
    direct = read_universal(universal)
    assert (direct.iteration, direct.consumed_train_samples) == (SAVED_AT, 24)
    out = tmp_path / "tp2pp2"
    assert convert.main(["--model-type", "GPT", "--loader", "universal", "--saver", "megatron",
                         "--load-dir", str(tmp / "z1"), "--save-dir", str(out),
                         "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "2"]) == 0
    again = load_full_checkpoint(str(out))
    assert (again.iteration, again.consumed_train_samples) == (SAVED_AT, 24)
    assert again.scheduler == direct.scheduler and again.scheduler["num_steps"] == 24
    assert again.model.keys() == direct.model.keys()
    for name, tensor in direct.model.items():
        torch.testing.assert_close(again.model[name], tensor, rtol=0, atol=0, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(again.optimizer["param_state"][name][key],
                                       direct.optimizer["param_state"][name][key], rtol=0,
                                       atol=0, msg=(name, key))
    assert again.optimizer["step"] == direct.optimizer["step"] == SAVED_AT
    core = tmp_path / "core"
    assert convert.main(["--model-type", "GPT", "--loader", "universal", "--saver", "core",
                         "--load-dir", str(universal.path), "--save-dir", str(core)]) == 0
    as_dist = load_full_checkpoint(str(core))
    for name, tensor in direct.model.items():
        torch.testing.assert_close(as_dist.model[name], tensor, rtol=0, atol=0, msg=name)


def test_damaged_universal_folder_is_named_in_one_line(universal_launch, tmp_path):
    """A parameter's file missing, or cut short: the converter and pretrain_gpt.py (the
    built-in engine) end with one ``error:`` line naming it, no traceback."""
    _, _, tmp = universal_launch
    source = tmp / "z1" / f"global_step{SAVED_AT}_universal"
    param = source.name + "/zero/encoder.layers.0.self_attention.query_key_value.weight"
    cases = {"missing": ("exp_avg.pt", "does not exist"),
             "truncated": ("fp32.pt", "is truncated, corrupt or not a torch file")}
    for case, (name, says) in cases.items():
        copy = tmp_path / case
        shutil.copytree(tmp / "z1", copy)
        target = copy / param / name
        if case == "missing":
            target.unlink()
        else:
            target.write_bytes(target.read_bytes()[:200])
        out = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--model-type",
                              "GPT", "--loader", "universal", "--load-dir", str(copy),
                              "--save-dir", str(tmp_path / f"out_{case}")], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 1
        assert out.stderr.strip().splitlines()[-1].startswith("error: ")
        assert str(target) in out.stderr and says in out.stderr, out.stderr
        assert not (tmp_path / f"out_{case}").exists()
    # The training command, built-in engine, one process.
    run = subprocess.run([sys.executable, "pretrain_gpt.py", *_run(**{
        "--load": tmp_path / "truncated", "--universal-checkpoint": True})], cwd=REPO,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read universal checkpoint file ") and \
        str(tmp_path / "truncated" / param / "fp32.pt") in last, run.stderr[-3000:]
    assert "Traceback" not in run.stderr

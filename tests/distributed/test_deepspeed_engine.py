"""DeepSpeed's engine behind --deepspeed, through the real ``deepspeed`` launcher on CPU
(gloo): ZeRO 1, 2 and 3 (2 ranks) and tensor parallel 2 + ZeRO-1 (4 ranks) give the
one-process built-in losses and grad norms within 1e-5 relative over 5 iterations, and the
log shows DeepSpeed's own engine lines; its pipeline engine at pp 2 equals the built-in pp 2
(the Llama family's options too: ZeRO 1-3 and the pipeline engine with its untied head);
a DeepSpeed checkpoint resumes bit for bit; DeepSpeed's recompute replays dropout; real
ZeRO-1, ZeRO-3 and pipeline checkpoints convert to ours and train on without DeepSpeed, and
tools/generate_text.py and tools/evaluate.py read them as they are. Two launches in all: tests/distributed/deepspeed_driver.py runs the 2-rank trainings one after
the other in one launch; the 4-rank one is the user's own `deepspeed pretrain_gpt.py` command."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.conversion import load_full_checkpoint
from megatron.core import parallel_state
from megatron.model.gpt_model import GPTModel
from tests.dist_utils import free_port, run_distributed
from tests.distributed.training_utils import LLAMA_FLAGS, flags_to_argv, parse_log_lines
from tools.checkpoint import convert

REPO = Path(__file__).resolve().parents[2]
ITERS = 5
DAMAGED = "global_step3/mp_rank_00_model_states.pt"
pytestmark = pytest.mark.skipif(shutil.which("deepspeed") is None,
                                reason="the deepspeed launcher is not installed")


def argv(**overrides) -> list[str]:
    """A tiny fp32 GPT on mock data, 5 iterations of global batch 8."""
    flags = {
        "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4,
        "--seq-length": 32, "--max-position-embeddings": 32, "--micro-batch-size": 2,
        "--global-batch-size": 8, "--train-iters": ITERS, "--lr-decay-iters": ITERS,
        "--lr": 1e-3, "--min-lr": 1e-4, "--lr-warmup-iters": 1, "--lr-decay-style": "cosine",
        "--clip-grad": 1.0, "--hidden-dropout": 0.0, "--attention-dropout": 0.0,
        "--log-interval": 1, "--eval-interval": 5, "--eval-iters": 2, "--num-workers": 0,
        "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": 127,
        "--make-vocab-size-divisible-by": 64, "--seed": 1234, "--use-cpu": True,
    }
    flags.update(overrides)
    return flags_to_argv(flags)


def zero(stage: int, **more) -> list[str]:
    return argv(**{"--deepspeed": True, "--no-pipeline-parallel": True,
                   "--zero-stage": stage, **more})


def launch(num_ranks: int, runs: dict[str, list[str]], tmp_path: Path) -> tuple[dict, str]:
    """Run ``runs`` (name -> argv) in one ``deepspeed --num_gpus N`` launch; returns each
    run's {"train": [[iteration, loss, grad norm]], "valid": loss} and the launch's output."""
    out = tmp_path / f"results{num_ranks}.json"
    spec = tmp_path / f"spec{num_ranks}.json"
    spec.write_text(json.dumps({"out": str(out), "runs": [
        {"name": name, **(a if isinstance(a, dict) else {"argv": a})}
        for name, a in runs.items()]}, default=str))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "DS_TEST_SPEC": str(spec)}
    cmd = [shutil.which("deepspeed"), "--num_gpus", str(num_ranks), "--master_port",
           str(free_port()), "tests/distributed/deepspeed_driver.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    return json.loads(out.read_text()), log


def _train(rank, world_size, args):
    state = pretrain_gpt.main(args)
    return {"train": [[h["iteration"], h["losses"]["lm loss"], h["grad_norm"]]
                      for h in state.history],
            "valid": state.last_valid_losses["lm loss"]}


def assert_same(got, expected, rel=1e-5):
    """Training losses and grad norms, and the validation loss at iteration 5."""
    assert [g[0] for g in got["train"]] == [e[0] for e in expected["train"]]
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(got["train"], expected["train"]):
        assert math.isclose(loss, ref_loss, rel_tol=rel), (it, loss, ref_loss)
        assert math.isclose(norm, ref_norm, rel_tol=rel), (it, norm, ref_norm)
    if expected["valid"] is not None:
        assert math.isclose(got["valid"], expected["valid"], rel_tol=rel)


@pytest.fixture(scope="module")
def reference():
    """The built-in engine in one process."""
    run = run_distributed(_train, 1, argv())[0]
    assert len(run["train"]) == ITERS and run["valid"] is not None
    return run


@pytest.fixture(scope="module")
def llama_reference():
    """The built-in engine in one process, the Llama family's options."""
    return run_distributed(_train, 1, argv(**LLAMA_FLAGS))[0]


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    """All the 2-rank DeepSpeed trainings in one launch: (results, log, folder)."""
    tmp_path = tmp_path_factory.mktemp("ds2")
    ckpt, pipe_ckpt = tmp_path / "ds_ckpt", tmp_path / "ds_pipe_ckpt"
    pipe = {"--deepspeed": True, "--zero-stage": 1, "--pipeline-model-parallel-size": 2}
    dropout = {"--tensor-model-parallel-size": 2, "--hidden-dropout": 0.1,
               "--attention-dropout": 0.1}
    runs = {
        # ZeRO-2 starts with --load of a folder that does not exist yet (a first run).
        "zero1": zero(1), "zero2": zero(2, **{"--load": tmp_path / "not_yet"}), "zero3": zero(3),
        # Stopped (and saved) at iteration 3, then the same command with --load.
        "zero1_first3": zero(1, **{"--exit-interval": 3, "--save": ckpt,
                                   "--save-interval": 100}),
        "zero1_resumed": zero(1, **{"--load": ckpt}),
        # One byte of a copy flipped: --load stops naming the file (checked against the
        # manifest before DeepSpeed reads anything).
        "zero1_damaged": {"argv": zero(1, **{"--load": tmp_path / "damaged"}),
                          "damage": [str(ckpt), str(tmp_path / "damaged"), DAMAGED]},
        # ZeRO-3's checkpoint (partitioned parameters) for the conversion test.
        "zero3_first3": zero(3, **{"--exit-interval": 3, "--save": tmp_path / "ds_zero3_ckpt",
                                   "--save-interval": 100}),
        # Tensor parallel 2 (two mp_rank_XX files) for the conversion test.
        "zero1_tp2_first3": zero(1, **{"--tensor-model-parallel-size": 2, "--exit-interval": 3,
                                       "--save": tmp_path / "ds_tp2_ckpt",
                                       "--save-interval": 100}),
        "pipe_pp2": argv(**pipe),
        "pipe_pp2_first3": argv(**pipe, **{"--exit-interval": 3, "--save": pipe_ckpt,
                                           "--save-interval": 100}),
        "pipe_pp2_resumed": argv(**pipe, **{"--load": pipe_ckpt}),
        "native_pp2": argv(**{"--pipeline-model-parallel-size": 2}),
        # The Llama family (untied LM head, SwiGLU, GQA, RMSNorm) through the pipeline
        # engine, and its layer files for the conversion test.
        "pipe_pp2_llama": argv(**pipe, **LLAMA_FLAGS),
        **{f"zero{stage}_llama": zero(stage, **LLAMA_FLAGS) for stage in (1, 2, 3)},
        "pipe_pp2_llama_first3": argv(**pipe, **LLAMA_FLAGS, **{
            "--exit-interval": 3, "--save": tmp_path / "ds_pipe_llama_ckpt",
            "--save-interval": 100}),
        "native_pp2_llama": argv(**{"--pipeline-model-parallel-size": 2}, **LLAMA_FLAGS),
        # DeepSpeed's activation checkpointing (tp 2) replays dropout from our RNG tracker:
        # the recomputed layers give the gradients of the built-in run without recompute.
        "tp2_ds_recompute": zero(1, **dropout, **{
            "--deepspeed-activation-checkpointing": True, "--partition-activations": True,
            "--recompute-granularity": "full", "--recompute-method": "uniform"}),
        "tp2_native_dropout": argv(**dropout),
        # DeepSpeed-Ulysses (Megatron-DeepSpeed's flag) through the engine with ZeRO: the
        # sequence split over both ranks, ZeRO over data x sequence ranks (stage 3 is
        # refused: DeepSpeed's own stage 3 does not reduce such gradients right).
        **{f"ulysses2_zero{stage}": zero(stage, **{"--ds-sequence-parallel-size": 2})
           for stage in (1, 2)},
        "ulysses2_zero1_llama": zero(1, **LLAMA_FLAGS, **{"--ds-sequence-parallel-size": 2}),
    }
    results, log = launch(2, runs, tmp_path)
    return results, log, tmp_path


def test_zero_stages_pipeline_and_resume_two_ranks(reference, llama_reference, two_rank_launch):
    results, log, tmp_path = two_rank_launch
    ckpt, pipe_ckpt = tmp_path / "ds_ckpt", tmp_path / "ds_pipe_ckpt"
    for stage in (1, 2, 3):
        assert_same(results[f"zero{stage}"], reference)
        assert_same(results[f"zero{stage}_llama"], llama_reference)  # RMSNorm, SwiGLU, GQA
        if stage < 3:
            assert_same(results[f"ulysses2_zero{stage}"], reference)
        # DeepSpeed's own configuration print, and our line naming the stage.
        assert re.search(rf"\[config.py:\d+:print\] +zero_optimization_stage \.+ {stage}\n",
                         log), stage
        assert re.search(rf"> DeepSpeed engine \S+: ZeRO stage {stage}, plain model", log)
    assert "[Rank 0] step=5, skipped=0" in log  # DeepSpeed's engine stepped
    # The first start with --load: one line of ours, none of DeepSpeed's (one per rank).
    assert log.count("no DeepSpeed checkpoint there ('latest' file missing)") == 1
    assert "Unable to find latest file" not in log
    # Pipeline engine: DeepSpeed's PipelineModule at pp 2 against the built-in 1F1B at pp 2.
    # DeepSpeed's partition: stage 0 holds the embedding and the first layer.
    assert "pipeline engine (PipelineModule)" in log and "STAGE=0 LAYERS=2 [0, 2)" in log
    assert_same(results["pipe_pp2"], results["native_pp2"])
    assert_same(results["native_pp2"], reference)
    # Untied (the Llama family): the LM head is its own last layer spec (LMHeadPipe).
    assert_same(results["pipe_pp2_llama"], results["native_pp2_llama"])
    assert_same(results["native_pp2_llama"], llama_reference)
    assert_same(results["ulysses2_zero1_llama"], llama_reference)  # GQA heads split too
    assert llama_reference["train"] != reference["train"]
    # Resume: iterations 4 and 5 after loading iteration 3 are those of the unbroken run.
    assert (ckpt / "latest").read_text().strip() == "global_step3"
    assert "loaded DeepSpeed checkpoint" in log
    # Our manifest lists every file DeepSpeed wrote, with its size and CRC-32.
    folder = ckpt / "global_step3"
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = {p.relative_to(folder).as_posix(): p.stat().st_size
               for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert DAMAGED.split("/")[1] in on_disk and any("optim_states" in rel for rel in on_disk)
    assert {rel: e["size"] for rel, e in manifest["files"].items()} == on_disk
    assert manifest["iteration"] == 3 and manifest["parallel_layout"]["engine"] == "deepspeed"
    assert not list(ckpt.glob("*.tmp-*")) and not list(folder.glob("*.tmp-*"))
    # The damaged copy is refused on every rank, naming the file and its CRC-32.
    error = results["zero1_damaged"]["error"]
    assert re.search(rf"{re.escape(DAMAGED)} is damaged: its CRC-32 is \w+, \S+manifest.json "
                     r"recorded", error), error
    resumed = results["zero1_resumed"]
    assert [r[0] for r in resumed["train"]] == [4, 5]
    assert resumed["train"] == results["zero1"]["train"][3:]  # bit for bit
    assert resumed["valid"] == results["zero1"]["valid"]
    # The same through the pipeline engine's checkpoints (one file per layer).
    assert (pipe_ckpt / "latest").read_text().strip() == "global_step3"
    resumed = results["pipe_pp2_resumed"]
    assert resumed["train"] == results["pipe_pp2"]["train"][3:]
    assert resumed["valid"] == results["pipe_pp2"]["valid"]
    # The built-in engine refuses DeepSpeed's checkpoint, saying what to do.
    from megatron.checkpointing import CheckpointError, check_load_dir

    with pytest.raises(CheckpointError, match="DeepSpeed checkpoint.*add --deepspeed"):
        check_load_dir(str(ckpt))
    assert "----Partition Activations True" in log  # DeepSpeed's checkpoint ran
    assert_same(results["tp2_ds_recompute"], results["tp2_native_dropout"])
    assert results["tp2_native_dropout"]["train"] != reference["train"]  # dropout was on


def _ids() -> torch.Tensor:
    return torch.randint(0, 127, (2, 32), generator=torch.Generator().manual_seed(7))  # [b, s]


def _logits(config, state: dict) -> torch.Tensor:
    model = GPTModel(config).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(_ids())  # [b, s, padded vocab]


def _train_each(rank, world_size, runs):
    out = {}
    for name, args in runs.items():
        out[name] = _train(rank, world_size, args)
        parallel_state.destroy_model_parallel()
    return out


def test_real_deepspeed_checkpoints_convert_and_train_on(two_rank_launch, tmp_path):
    """ZeRO-1 (tp 1 and tp 2), ZeRO-3 and pipeline (pp 2) checkpoints written by our
    --deepspeed engine at iteration 3 convert with `convert.py --loader deepspeed --saver
    megatron`; the converted model's logits equal those of the model the ZeRO-1 engine saved,
    and `--load` of the converted folder without --deepspeed trains on from iteration 4 with
    the DeepSpeed run's losses: ZeRO-1's optimizer state (plain and pipeline) is converted too,
    so iterations 4 and 5 (losses and grad norms) continue the DeepSpeed run; ZeRO-3's is not
    (--no-load-optim, LR schedule carried), so iteration 4, which only the weights decide."""
    results, _, launched = two_rank_launch
    sources = {"zero1": "ds_ckpt", "zero1_tp2": "ds_tp2_ckpt", "zero3": "ds_zero3_ckpt",
               "pipe_pp2": "ds_pipe_ckpt", "pipe_pp2_llama": "ds_pipe_llama_ckpt"}
    with_optimizer = {"zero1", "zero1_tp2", "pipe_pp2", "pipe_pp2_llama"}
    family = {"pipe_pp2_llama": LLAMA_FLAGS}
    same_as = {"zero1_tp2": "zero1"}  # the run whose iterations 4-5 it continues
    engine_module = torch.load(launched / "ds_ckpt" / "global_step3" / "mp_rank_00_model_states.pt",
                               map_location="cpu", weights_only=False)["module"]
    continued = {}
    for run, folder in sources.items():
        out = tmp_path / f"converted_{run}"
        assert convert.main(["--model-type", "GPT", "--loader", "deepspeed", "--saver",
                             "megatron", "--load-dir", str(launched / folder),
                             "--save-dir", str(out)]) == 0
        full = load_full_checkpoint(str(out))
        assert (full.iteration, full.consumed_train_samples) == (3, 24)
        assert full.scheduler is not None and full.scheduler["num_steps"] == 24
        assert (full.optimizer is not None) == (run in with_optimizer), run
        if run in family:  # its own model: the names and shapes GPTModel has (untied head)
            built = GPTModel(full.model_config()).state_dict()
            assert {k: v.shape for k, v in full.model.items()} == {
                k: v.shape for k, v in built.items()}
        else:
            assert full.model.keys() == engine_module.keys()
            want = _logits(full.model_config(), engine_module)
            got = _logits(full.model_config(), full.model)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=run)
        continued[run] = argv(**family.get(run, {}), **{
            "--load": out, "--no-load-optim": run not in with_optimizer})
    trained = run_distributed(_train_each, 1, continued)[0]
    for run, got in trained.items():
        want = results[same_as.get(run, run)]
        assert [t[0] for t in got["train"]] == [4, 5], run
        if run in with_optimizer:
            assert_same(got, {"train": want["train"][3:], "valid": want["valid"]})
        else:
            assert math.isclose(got["train"][0][1], want["train"][3][1], rel_tol=1e-5), run
            # A fresh optimizer: iteration 5 leaves the DeepSpeed run's curve.
            assert not math.isclose(got["train"][1][1], want["train"][4][1], rel_tol=1e-6), run


# Sampling as the nanoGPT/FineWeb users type it (top-k, then top-p); seeded.
SAMPLE = ["--prompt", "5 6 7", "--prompt", "9 10 11 12", "--max-new-tokens", "8",
          "--temperature", "0.75", "--top-k", "40", "--top-p", "0.95", "--seed", "3",
          "--ignore-eod", "--use-cpu"]


def _sample_and_evaluate(rank, world_size, runs, text_file):
    """Per (name, --load folder): tools/generate_text.py's completions (rank 0's output) and
    tools/evaluate.py's WikiText result, as the tools run them, one after the other."""
    import contextlib
    import io

    from megatron.inference.evaluation.friendly import main as evaluate
    from tools import generate_text

    out = {}
    for name, load in runs.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert generate_text.main(["--load", str(load), *SAMPLE]) == 0
        parallel_state.destroy_model_parallel()
        result = evaluate(["wikitext", str(text_file), "--load", str(load), "--use-cpu",
                           "--micro-batch-size", "2"])
        parallel_state.destroy_model_parallel()
        out[name] = (generate_text.read_samples(printed.getvalue()), result.avg_loss)
    return out


@pytest.mark.slow
def test_generation_and_evaluation_read_deepspeed_checkpoints(two_rank_launch, tmp_path):
    """tools/generate_text.py and tools/evaluate.py --load the DeepSpeed checkpoints themselves
    (plain engine ZeRO-1 at tp 1 and 2, ZeRO-3, pipeline engine at pp 2): the same sampled
    tokens and WikiText loss as from the same weights converted to ours by convert.py, in
    one process; and at the saved layouts over 2 ranks (the tp 2 checkpoint at tp 2, the
    pipeline one at pp 2), the one-process tokens and loss."""
    _, _, launched = two_rank_launch
    sources = {"zero1": "ds_ckpt", "zero1_tp2": "ds_tp2_ckpt", "zero3": "ds_zero3_ckpt",
               "pipe_pp2": "ds_pipe_ckpt"}
    runs = {}
    for run, folder in sources.items():
        ours = tmp_path / f"ours_{run}"
        assert convert.main(["--model-type", "GPT", "--loader", "deepspeed", "--saver",
                             "megatron", "--load-dir", str(launched / folder),
                             "--save-dir", str(ours)]) == 0
        runs[run], runs[f"{run}_converted"] = launched / folder, ours
    text = tmp_path / "ids.txt"  # WikiText-style lines of NullTokenizer ids
    ids = torch.randint(0, 126, (12, 40), generator=torch.Generator().manual_seed(2)).tolist()
    text.write_text("".join(" ".join(map(str, row)) + "\n" for row in ids))
    one = run_distributed(_sample_and_evaluate, 1, runs, text)[0]
    for run in sources:
        (lines, loss), (want_lines, want_loss) = one[run], one[f"{run}_converted"]
        assert len(lines) == 2 and all(len(line.split()) == n + 8
                                       for line, n in zip(lines, (3, 4))), lines
        assert lines == want_lines, run
        assert math.isclose(loss, want_loss, rel_tol=1e-6), (run, loss, want_loss)
        assert 3.0 < loss < 6.0, loss  # trained 3 iterations: near log(127) = 4.84
    saved_layout = {k: launched / sources[k] for k in ("zero1_tp2", "pipe_pp2")}
    two = run_distributed(_sample_and_evaluate, 2, saved_layout, text)[0]
    for run, (lines, loss) in two.items():
        assert lines == one[run][0], run
        assert math.isclose(loss, one[run][1], rel_tol=1e-5), (run, loss, one[run][1])


def test_tensor_parallel_2_with_zero1_four_ranks(reference, tmp_path):
    # The user's own command: `deepspeed --num_gpus 4 pretrain_gpt.py ... --deepspeed`
    # (the launcher adds --local_rank); the numbers are read from the Megatron log lines.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [shutil.which("deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
           "pretrain_gpt.py", *zero(1, **{"--tensor-model-parallel-size": 2})]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    assert re.search(r"> DeepSpeed engine \S+: ZeRO stage 1, plain model", log)
    assert re.search(r"\[config.py:\d+:print\] +zero_optimization_stage \.+ 1\n", log)
    lines = parse_log_lines(log)
    assert [line["iteration"] for line in lines] == list(range(1, ITERS + 1))
    for line, (_, ref_loss, ref_norm) in zip(lines, reference["train"]):
        assert math.isclose(line["lm loss"], ref_loss, rel_tol=1e-5), (line, ref_loss)
        assert abs(line["grad norm"] - ref_norm) <= 1e-3  # the log prints 3 decimals
    valid = re.search(r"validation loss at iteration 5 \| lm loss value: (\S+)", log)
    assert math.isclose(float(valid.group(1)), reference["valid"], rel_tol=1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x"]))

"""Resuming with other flags, and checkpoints that do not fit: what the user is told.

A schedule that differs from the checkpoint's (a longer --train-iters that moves the decay,
another --lr: what the NaN stop advises) ends the run before any model exists, on rank 0,
naming the values, their flags and the flag that resolves it; the resolutions it names work,
and a longer run whose schedule does not change resumes without any. A tensor-parallel 2
checkpoint missing mp_rank_01 is called incomplete (its manifest says tp 2), not "saved with
tp 1"; loading it at another layout prints the converter command with the real paths and
sizes, and that command, run as printed, gives a checkpoint that trains on.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.checkpointing import CheckpointError, CheckpointLayoutError
from megatron.core import parallel_state
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import flags_to_argv, parse_log_lines
from tools.checkpoint import convert

pytestmark = pytest.mark.slow
ITERS = 4


def _argv(**overrides) -> list[str]:
    """A tiny fp32 GPT on mock data; global batch 4."""
    flags = {
        "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4,
        "--seq-length": 16, "--max-position-embeddings": 16, "--micro-batch-size": 2,
        "--global-batch-size": 4, "--train-iters": ITERS, "--lr": 1e-3, "--min-lr": 1e-4,
        "--lr-warmup-iters": 1, "--lr-decay-style": "cosine", "--log-interval": 1,
        "--eval-iters": 0, "--num-workers": 0, "--mock-data": True,
        "--tokenizer-type": "NullTokenizer", "--vocab-size": 127,
        "--make-vocab-size-divisible-by": 64, "--use-cpu": True,
    }
    flags.update(overrides)
    return flags_to_argv(flags)


def _run(argv: list[str]) -> dict:
    """pretrain_gpt.main in this rank: exit code, iterations trained, output, error."""
    parallel_state.destroy_model_parallel()
    out, err = io.StringIO(), io.StringIO()
    result = {"code": 0, "iterations": [], "error": None}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            state = pretrain_gpt.main(argv)
            result["iterations"] = [h["iteration"] for h in state.history]
        except SystemExit as exit_:
            result["code"] = exit_.code
        except CheckpointError as error:
            result["code"], result["error"] = 1, (type(error).__name__, str(error))
    result.update(out=out.getvalue(), err=err.getvalue())
    return result


def _one_rank_runs(rank, world_size, save, tp2_save):
    """The schedule runs, then the tp 2 checkpoint loaded at tp 1 (one spawn for both)."""
    first = _run(_argv(**{"--save": save, "--save-interval": ITERS}))
    runs = {"first": first}
    longer = {"--load": save, "--train-iters": 2 * ITERS}
    runs["longer"] = _run(_argv(**longer))
    runs["longer_override"] = _run(_argv(**longer, **{"--override-opt_param-scheduler": True,
                                                      "--lr": 5e-4}))
    # The same checkpoint, decay length pinned to the first run's: nothing to choose.
    runs["longer_same_decay"] = _run(_argv(**longer, **{"--lr-decay-iters": ITERS}))
    runs["lower_lr"] = _run(_argv(**{"--load": save, "--lr": 5e-4}))
    runs["reshard"] = _reshard_runs(tp2_save)
    return runs


def _tp2_runs(rank, world_size, save, incomplete):
    first = _run(_argv(**{"--tensor-model-parallel-size": 2, "--exit-interval": 1,
                          "--save": save, "--save-interval": 100}))
    if rank == 0:
        shutil.copytree(save, incomplete)
        shutil.rmtree(f"{incomplete}/iter_0000001/mp_rank_01")
    dist.barrier()
    missing = _run(_argv(**{"--tensor-model-parallel-size": 2, "--load": incomplete}))
    return first, missing


def _reshard_runs(save):
    other_layout = _run(_argv(**{"--load": save}))
    kind, message = other_layout["error"]
    command = message.split("`")[1]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "tools/checkpoint/convert.py"]
    assert convert.main(argv[2:]) == 0
    new = message.rsplit("then --load ", 1)[1]
    return kind, message, _run(_argv(**{"--load": new}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two spawns: the tp 2 save (and its incomplete copy) on 2 ranks, then the rest on 1."""
    folder = tmp_path_factory.mktemp("resume")
    save, tp2, incomplete = (str(folder / name) for name in ("ckpt", "tp2", "tp2-incomplete"))
    tp2_ranks = run_distributed(_tp2_runs, 2, tp2, incomplete)
    one = run_distributed(_one_rank_runs, 1, save, tp2)[0]
    return dict(save=save, tp2=tp2, incomplete=incomplete, tp2_ranks=tp2_ranks, **one)


def test_a_schedule_change_is_refused_at_start_up_naming_values_and_flags(runs):
    save = runs["save"]
    assert runs["first"]["iterations"] == [1, 2, 3, 4]
    longer = runs["longer"]
    assert longer["code"] == 2 and "building GPT model" not in longer["out"]
    lines = longer["err"].splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --load {save}: {save}/iter_0000004: ")
    assert ("decay length 8 iterations here, 4 in the checkpoint (--lr-decay-iters / "
            "--lr-decay-samples (default: --train-iters / --train-samples))") in lines[0]
    assert "--use-checkpoint-opt_param-scheduler" in lines[0]
    assert "--override-opt_param-scheduler" in lines[0] and "Traceback" not in longer["err"]
    lower = runs["lower_lr"]
    assert lower["code"] == 2
    assert "learning rate 0.0005 here, 0.001 in the checkpoint (--lr)" in lower["err"]


def test_what_the_messages_advise_resumes(runs):
    # The flag the error names, and a decay pinned to the checkpoint's (only the unused
    # weight-decay increment length differs): both train iterations 5-8.
    for name in ("longer_override", "longer_same_decay"):
        assert runs[name]["code"] == 0, runs[name]["err"][-2000:]
        assert runs[name]["iterations"] == [5, 6, 7, 8], name
    # What the NaN stop advises, a lower --lr with the override, follows the new --lr.
    rates = [line["learning rate"] for line in parse_log_lines(runs["longer_override"]["out"])]
    assert len(rates) == 4 and max(rates) <= 5e-4


def test_an_incomplete_tp2_checkpoint_and_the_reshard_command(runs):
    save, incomplete = runs["tp2"], runs["incomplete"]
    (first, missing), (first_1, missing_1) = runs["tp2_ranks"]
    assert first["iterations"] == first_1["iterations"] == [1]
    # Every rank stops; rank 0's message (the one pretrain_gpt.py prints) names the cause.
    assert missing["code"] == missing_1["code"] == 1
    kind, message = missing["error"]
    assert kind == "CheckpointCorruptError"
    assert (f"checkpoint {incomplete}/iter_0000001 is incomplete: "
            f"{incomplete}/iter_0000001/manifest.json lists 2 files "
            "of a save with tensor-model-parallel size 2 and pipeline-model-parallel size 1; "
            f"checkpoint file {incomplete}/iter_0000001/mp_rank_01/model_optim_rng.pt does not "
            "exist") in message
    assert "saved with tensor-model-parallel size 1" not in message

    kind, message, resumed = runs["reshard"]
    assert kind == "CheckpointLayoutError" and issubclass(CheckpointLayoutError, CheckpointError)
    assert "tp=2, pp=1); this run has tp=1, pp=1" in message
    assert (f"--load-dir {save} --save-dir {save}_tp1_pp1 --target-tensor-parallel-size 1 "
            "--target-pipeline-parallel-size 1`") in message
    assert resumed["code"] == 0, resumed["err"][-2000:]
    assert resumed["iterations"] == [2, 3, 4]

"""pretrain_gpt.py against damaged checkpoints and unusable --load/--save, as a user meets them.

A tiny run (mock data, CPU) saves at iteration 2; each test copies that checkpoint, damages
it, and resumes through the real CLI. Asserted each time: the exit status, the message (the
file and the flag named), and that nothing was left or lost (the checkpoint folder is as it
was, no training step ran on bad weights, no new checkpoint was written).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from megatron.checkpointing import list_iterations, read_tracker
from tests.checkpoint_utils import flip_bytes, folder_state
from tests.distributed.training_utils import base_argv, parse_log_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOCK = {"prefix": None,  # no dataset files: synthetic tokens (--mock-data)
        "tokenizer_flags": ["--mock-data", "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "500"]}


def _argv(**flags) -> list[str]:
    # One --train-iters for both halves: the scheduler refuses another schedule on resume.
    return base_argv(MOCK, "unused", **{"--data-path": None, "--data-cache-path": None,
                                        "--train-iters": 4, "--lr-decay-iters": 1000, **flags})


def _run(**flags) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
                           *_argv(**flags)], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=180)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of iteration 2: with the plain and with the distributed optimizer."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for name, flags in (("plain", {}), ("distopt", {"--use-distributed-optimizer": True})):
        save = str(root / name)
        done = _run(**{"--save": save, "--save-interval": 2, "--exit-interval": 2}, **flags)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert read_tracker(save).iteration == 2
        out[name] = (save, flags)
    return out


def _copy(saved, tmp_path, name: str = "plain"):
    source, flags = saved[name]
    copy = str(tmp_path / "ckpt")
    shutil.copytree(source, copy)
    return copy, flags


def _resume(load: str, **flags) -> tuple[subprocess.CompletedProcess, str]:
    done = _run(**{"--load": load}, **flags)
    return done, done.stdout + done.stderr


def _damage(path: str, how: str) -> None:
    if how == "flipped":
        flip_bytes(path)
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1000)
    else:
        os.remove(path)


@pytest.mark.parametrize("name,file,how,expected", [
    ("plain", "model_optim_rng.pt", "flipped", "is damaged: its CRC-32 is"),
    ("distopt", "distrib_optim.pt", "flipped", "is damaged: its CRC-32 is"),
    ("plain", "model_optim_rng.pt", "truncated", "is damaged: it has"),
    ("plain", "model_optim_rng.pt", "missing", "does not exist"),
], ids=["flipped-model", "flipped-distrib-optim", "truncated", "missing"])
def test_damaged_checkpoint_stops_the_resume_naming_the_file(saved, tmp_path, name, file, how,
                                                              expected):
    load, flags = _copy(saved, tmp_path, name)
    path = os.path.join(load, "iter_0000002", "mp_rank_00", file)
    _damage(path, how)
    before = folder_state(load)
    done, output = _resume(load, **flags)
    assert done.returncode == 1, output[-3000:]
    assert f"checkpoint file {path} {expected}" in output, output[-3000:]
    assert "Traceback" not in done.stderr and "error: " in done.stderr  # the message only
    assert os.path.join(load, "iter_0000002", "manifest.json") in output
    assert parse_log_lines(done.stdout) == []  # not one step on damaged weights
    assert folder_state(load) == before and read_tracker(load).iteration == 2


def test_no_verify_checkpoint_loads_without_checksums(saved, tmp_path):
    load, _ = _copy(saved, tmp_path)
    flip_bytes(os.path.join(load, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
    done, output = _resume(load, **{"--no-verify-checkpoint": True, "--exit-interval": 3})
    assert done.returncode == 0, output[-3000:]
    assert "training from iteration 2 to 4" in done.stdout
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [3]
    assert "damaged" not in output


def test_checkpoint_without_manifest_loads_with_one_notice(saved, tmp_path):
    """As a checkpoint saved before manifests, or by Megatron-LM, is loaded."""
    load, _ = _copy(saved, tmp_path)
    os.remove(os.path.join(load, "iter_0000002", "manifest.json"))
    done, output = _resume(load, **{"--exit-interval": 3})
    assert done.returncode == 0, output[-3000:]
    notices = [line for line in output.splitlines() if "not verified" in line]
    assert len(notices) == 1, notices
    assert os.path.join(load, "iter_0000002") in notices[0] and "no manifest.json" in notices[0]
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [3]


def test_resume_with_another_hidden_size_names_the_flag(saved, tmp_path):
    load, _ = _copy(saved, tmp_path)
    before = folder_state(load)
    done, output = _resume(load, **{"--hidden-size": 64})
    assert done.returncode == 1 and "Traceback" not in done.stderr, output[-3000:]
    iter_dir = os.path.join(load, "iter_0000002")
    assert (f"checkpoint {iter_dir} (--load {load}) has --hidden-size 32, you asked for 64"
            in output), output[-3000:]
    assert "size mismatch" not in output
    assert parse_log_lines(done.stdout) == []
    assert folder_state(load) == before


def test_load_of_a_regular_file_is_a_user_error(saved, tmp_path):
    load, _ = _copy(saved, tmp_path)
    path = os.path.join(load, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    before = folder_state(load)
    done, output = _resume(path)
    assert done.returncode == 2, output[-3000:]
    assert done.stderr.startswith(f"error: --load {path} is a file, not a checkpoint folder")
    assert "number of parameters" not in done.stdout  # stopped before the model was built
    assert folder_state(load) == before


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_save_that_cannot_be_written_is_a_user_error(tmp_path, where):
    """As root (these tests' usual user) permission bits do not stop writes, so the
    unwritable folder is shown by the unit test that refuses the probe file."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    save = a_file if where == "a-file" else a_file / "ckpt"
    done = _run(**{"--save": save, "--save-interval": 2})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    expected = (f"error: --save {save} is a file, not a folder" if where == "a-file" else
                f"error: --save {save} cannot be created: {a_file} is a file")
    assert done.stderr.startswith(expected), done.stderr[-2000:]
    assert "number of parameters" not in done.stdout
    assert a_file.read_text() == "keep me" and os.listdir(tmp_path) == ["notes.txt"]
    assert list_iterations(str(tmp_path)) == []

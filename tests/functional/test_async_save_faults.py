"""--async-save and the --save folder under faults, through the real CLI (mock data, CPU, the
distributed optimizer, whose state the background write streams): a SIGKILL during a
background write leaves the previous checkpoint the latest and loadable, and the resume
repeats the killed run's losses; SIGTERM or Ctrl-C while one is written finishes it first; a
disk that fills up during a background write stops the run naming the file, and the previous
checkpoint stays; a second run saving into a folder in use is refused at start-up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron.checkpointing import latest_checkpoint, list_iterations, read_tracker
from tests.checkpoint_utils import resize_tmpfs, small_tmpfs
from tests.distributed.training_utils import base_argv, parse_log_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(REPO, "tests", "functional", "async_save_driver.py")
MOCK = {"prefix": None, "tokenizer_flags": ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                            "--vocab-size", "500"]}


def _argv(save: str, **flags) -> list[str]:
    return base_argv(MOCK, "unused", **{
        "--data-path": None, "--data-cache-path": None, "--train-iters": 8,
        "--lr-decay-iters": 1000, "--save": save, "--load": save, "--save-interval": 2,
        "--use-distributed-optimizer": True, **flags})


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _start(save: str, hold: str = "", **flags) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, DRIVER, *_argv(save, **flags)], cwd=REPO,
                            env=_env(MEGATRON_TEST_HOLD_SAVE=hold), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(save: str, **flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, DRIVER, *_argv(save, **flags)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=240)


def _wait_for(mark: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(mark):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the held save never started"
        time.sleep(0.05)


def _losses(stdout: str) -> dict[int, float]:
    return {line["iteration"]: line["lm loss"] for line in parse_log_lines(stdout)}


def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    save, mark = str(tmp_path / "ckpt"), str(tmp_path / "writing")
    run = _start(save, f"4:120:{mark}", **{"--async-save": True})
    _wait_for(mark, run)
    time.sleep(1.0)  # training goes on meanwhile
    run.kill()
    out, _ = run.communicate()
    assert read_tracker(save).iteration == 2 and list_iterations(save) == [2]
    assert any(n.startswith("iter_0000004.tmp-") for n in os.listdir(save))
    latest = latest_checkpoint(save)
    latest.verify(checksums=True)  # complete and intact
    killed = _losses(out)
    assert max(killed) > 4  # the loop ran on while the checkpoint was being written

    resumed = _run(save, **{"--exit-interval": 4})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "training from iteration 2 to 8" in resumed.stdout
    again = _losses(resumed.stdout)
    assert list(again) == [3, 4] and all(again[i] == killed[i] for i in again)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]  # leftover gone


def _signal_while_writing(tmp_path, signum: int) -> tuple[str, str, str, list[int]]:
    """A run whose checkpoint of iteration 4 is held in its background write gets ``signum``
    meanwhile; it must exit with the signal's status once every save it started is
    published. Returns --save, the run's stdout and stderr, and the iterations it saved."""
    save, mark = str(tmp_path / "ckpt"), str(tmp_path / "writing")
    run = _start(save, f"4:3:{mark}", **{"--async-save": True})
    _wait_for(mark, run)
    run.send_signal(signum)
    out, err = run.communicate(timeout=240)
    assert run.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # The loop stops at the end of the iteration the signal came in (it may have started the
    # next save meanwhile): every save it started is published before it exits.
    saved = [int(line.split()[5]) for line in out.splitlines()
             if line.startswith("successfully saved checkpoint at iteration")]
    assert saved[:2] == [2, 4] and read_tracker(save).iteration == saved[-1]
    latest_checkpoint(save).verify(checksums=True)
    return save, out, err, saved


def test_sigterm_while_writing_finishes_the_checkpoint_first(tmp_path):
    _, out, _, _ = _signal_while_writing(tmp_path, signal.SIGTERM)
    assert "SIGTERM received while a checkpoint was written in the background: it was " \
           "finished first" in out


def test_ctrl_c_while_writing_finishes_the_checkpoint_then_exits_130(tmp_path):
    save, _, err, saved = _signal_while_writing(tmp_path, signal.SIGINT)
    # Ctrl-C's one line (as without --async-save), once the checkpoint is complete.
    assert err.strip().splitlines()[-1].startswith("interrupted (SIGINT, Ctrl-C) after iteration ")
    assert (f"; the latest checkpoint is iteration {saved[-1]} in --save {save}; resume with "
            "--load") in err


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_full_disk_during_a_background_write_stops_the_run_naming_the_file(tmp_path,
                                                                          ckpt_format):
    with small_tmpfs(tmp_path / "disk", 16 << 20) as disk:
        save = os.path.join(disk, "ckpt")
        first = _run(save, **{"--exit-interval": 2, "--ckpt-format": ckpt_format})
        assert first.returncode == 0, first.stderr[-3000:]
        used = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(save)
                   for n in names)
        resize_tmpfs(disk, used + used // 2)  # room for half of the next checkpoint
        done = _run(save, **{"--async-save": True, "--ckpt-format": ckpt_format})
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        error = done.stderr.strip().splitlines()[-1]
        assert error.startswith(f"error: saving the checkpoint of iteration 4 to {save} failed "
                                f"on rank 0: cannot write {save}/iter_0000004.tmp-"), error
        assert ": no space left on device (" in error and " bytes needed, " in error
        assert f" free in {save}/iter_0000004.tmp-" in error
        assert "the tracker file still names the previous checkpoint" in error
        # the temporary folder is gone; so is the lock (released as the run ended)
        assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        assert read_tracker(save).iteration == 2
        latest_checkpoint(save).verify(checksums=True)


def _torchrun(save: str, *extra: str, **flags) -> subprocess.CompletedProcess:
    from tests.dist_utils import free_port

    argv = _argv(save, **{"--use-distributed-optimizer": None, **flags})
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--master_port", str(free_port()), "pretrain_gpt.py", *argv,
                           *extra], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)


def _only_error_line(done: subprocess.CompletedProcess) -> str:
    """The run's one ``error:`` line; no rank printed a traceback of ours (torchrun's own
    report of the failed workers follows, as for any failed worker)."""
    output = done.stdout[-2000:] + done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert "megatron/" not in done.stderr and "basic_ios" not in done.stderr, output
    assert "unexpected pos" not in done.stderr and "Connection closed" not in done.stderr
    return errors[0]


@pytest.mark.parametrize("engine", ["torch_dist", "deepspeed"])
def test_full_disk_during_a_synchronous_save_at_data_parallel_2(tmp_path, engine):
    """Two ranks save onto a disk with room for half a checkpoint: one line naming the file
    and the space, the partial folder removed, the previous checkpoint the latest. DeepSpeed
    writes under a temporary tag too: a folder a killed save left is removed by the next
    save, and a start on a full disk names the lock file it cannot write."""
    extra = ["--deepspeed", "--zero-stage", "1"] if engine == "deepspeed" else \
        ["--ckpt-format", "torch_dist"]
    tracker, step, names_two = (("latest", "global_step", "global_step2")
                                if engine == "deepspeed" else
                                ("latest_checkpointed_iteration.txt", "iter_000000", "2"))
    with small_tmpfs(tmp_path / "disk", 32 << 20) as disk:
        save = os.path.join(disk, "ckpt")
        leftover = os.path.join(save, f"{step}9.tmp-killed")  # a save killed long ago
        os.makedirs(leftover)
        os.utime(leftover, (time.time() - 3600,) * 2)
        first = _torchrun(save, *extra, **{"--exit-interval": 2})
        assert first.returncode == 0, first.stderr[-3000:]
        kept = sorted(n for n in os.listdir(save) if not n.startswith("."))
        assert f"{step}2" in kept and os.path.basename(leftover) not in kept, kept
        used = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(save)
                   for n in names)
        resize_tmpfs(disk, used + used // 2)
        done = _torchrun(save, *extra)
        assert done.returncode != 0
        error = _only_error_line(done)
        assert error.startswith(f"error: saving the checkpoint of iteration 4 to {save} failed "
                                f"on rank 0: cannot write {save}/{step}4.tmp-"), error
        assert ": no space left on device (" in error and " bytes needed, " in error
        assert error.endswith("the tracker file still names the previous checkpoint")
        assert sorted(n for n in os.listdir(save) if not n.startswith(".")) == kept
        assert open(os.path.join(save, tracker)).read().strip() == names_two
        if engine != "deepspeed":
            return
        with contextlib.suppress(OSError), open(os.path.join(disk, "filler"), "wb") as f:
            while True:
                f.write(b"x" * 65536)
        full = _torchrun(save, *extra)
        assert _only_error_line(full).startswith(
            f"error: cannot lock --save: cannot write {save}/.megatron-save.lock: no space left "
            "on device (")


HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from megatron.checkpointing.lock import SaveLock
    SaveLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_a_second_run_saving_into_the_same_folder_is_refused(tmp_path):
    save = str(tmp_path / "ckpt")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=REPO), save],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        done = _run(save)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: --save {save} is in use by another run (host ")
    assert f"pid {holder.pid}, started " in done.stderr and "Traceback" not in done.stderr
    assert "building GPT model" not in done.stdout  # refused before the model was built
    assert sorted(os.listdir(save)) == [".megatron-save.lock"]


pytestmark = pytest.mark.slow

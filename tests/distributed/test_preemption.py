"""Preemption: SIGTERM as torchrun and SLURM deliver it, with DataLoader workers running.

On preemption torchrun and SLURM signal every process, the DataLoader workers included (a
process-group signal, or slurmstepd signalling each process of the job step). Two ranks with
``--num-workers 2`` and ``--exit-signal-handler``:

- torchrun, and the per-node launcher of ``deepspeed``: SIGTERM to the launcher's process
  group, as a job supervisor sends it. torchrun starts each rank in a session of its own and
  relays the signal to each rank's group (the rank and its workers); deepspeed's ranks share
  its group, so they get it directly and then again from the launcher, workers included;
- SLURM's pattern, without torchrun: two tasks started as ``srun`` starts them (SLURM_PROCID,
  SLURM_NTASKS), and SIGTERM sent to each process of each task, one at a time, the workers
  first, one task a moment before the other.

Every time, every rank agrees to stop at the same iteration, one checkpoint is saved, the ranks
exit normally, and a run resumed from that checkpoint finishes with losses and grad norms
equal, bit for bit, to those of a run that was never interrupted. A second SIGTERM while the
exit checkpoint is being written leaves a complete checkpoint.

Before the fix, the workers died first and the main process failed with "DataLoader worker
... killed by signal: Terminated", saving nothing.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron.checkpointing import list_iterations, read_tracker
from tests.dist_utils import free_port
from tests.distributed.training_utils import base_argv, build_small_corpus, load_benchmark

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDED = os.path.join(REPO, "tests", "distributed", "pretrain_recorded.py")
# Under torchrun and deepspeed the ranks hear of the signal from their launcher a moment
# later; iterations of this tiny model take milliseconds, so leave room to stop mid-run.
ITERS = 40
FLAGS = {"--train-iters": ITERS, "--num-workers": 2, "--exit-signal-handler": True,
         "--hidden-dropout": 0.1, "--attention-dropout": 0.1, "--lr-decay-iters": ITERS}
SIGNAL_AFTER = re.compile(r"^ iteration +3/", re.M)
EXITED = re.compile(r"exiting at iteration (\d+) \(SIGTERM received with "
                    r"--exit-signal-handler\); checkpoint saved")


# Launching as torchrun and srun do -------------------------------------------------------


def _env(history: str) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith("SLURM_")}
    os.makedirs(history, exist_ok=True)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "MEGATRON_TEST_HISTORY": history}


def _popen(cmd, log: str, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)


def _torchrun(argv, folder: str) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), RECORDED, *argv]
    return [_popen(cmd, f"{folder}/launcher.log", _env(f"{folder}/history"))]


def _deepspeed(argv, folder: str) -> list[subprocess.Popen]:
    """The per-node launcher that ``deepspeed`` runs, for two local ranks."""
    hosts = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={hosts}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", RECORDED, *argv]
    return [_popen(cmd, f"{folder}/launcher.log", _env(f"{folder}/history"))]


def _srun(argv, folder: str) -> list[subprocess.Popen]:
    """Two tasks with the environment ``srun --ntasks 2`` gives them (the launch scripts in
    examples/ set MASTER_ADDR/MASTER_PORT)."""
    env, port = _env(f"{folder}/history"), str(free_port())
    return [_popen([sys.executable, RECORDED, *argv], f"{folder}/task{rank}.log", {
        **env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        for rank in range(2)]


def _first_log(folder: str) -> str:
    """The launcher's output, or the first task's."""
    for name in ("launcher.log", "task0.log"):
        if os.path.exists(f"{folder}/{name}"):
            with open(f"{folder}/{name}") as f:
                return f.read()
    raise AssertionError(f"no log in {folder}")


def _wait_for_log(folder: str, pattern: re.Pattern, procs, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern.search(_first_log(folder)):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process exited early:\n{_first_log(folder)[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {pattern.pattern}")


def _wait(procs, timeout: float = 300.0) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


_children = load_benchmark("torchrun_restarts").children


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # already gone: it exited after the other rank's signal
        pass


def _histories(folder: str) -> list[list[dict]]:
    result = []
    for rank in range(2):
        with open(f"{folder}/history/rank{rank}.json") as f:
            result.append(json.load(f))
    return result


def _run(launch, argv, folder: str) -> tuple[list[int], str]:
    procs = launch(argv, folder)
    codes = _wait(procs)
    return codes, _first_log(folder)


# Fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """Each rank's history of an uninterrupted run."""
    folder = str(tmp_path_factory.mktemp("straight"))
    codes, log = _run(_torchrun, base_argv(corpus, f"{folder}/cache", **FLAGS), folder)
    assert codes == [0], log[-3000:]
    histories = _histories(folder)
    assert [h["iteration"] for h in histories[0]] == list(range(1, ITERS + 1))
    return histories


def _check_interrupted_then_resume(corpus, folder: str, launch, log: str, straight) -> None:
    """One checkpoint at the iteration every rank stopped at; resuming from it reproduces
    the uninterrupted run exactly."""
    assert "killed by signal" not in log and "DataLoader worker" not in log, log[-3000:]
    found = EXITED.search(log)
    assert found, log[-3000:]
    stop = int(found.group(1))
    assert 3 <= stop <= ITERS - 5, log[-3000:]
    assert len(re.findall(r"saved checkpoint at iteration", log)) == 1  # saved once
    save = f"{folder}/ckpt"
    assert read_tracker(save).iteration == stop and list_iterations(save) == [stop]
    assert not [d for d in os.listdir(save) if ".tmp-" in d]
    first = _histories(folder)  # written when pretrain() returned, on every rank
    assert [[h["iteration"] for h in ranks] for ranks in first] == [list(range(1, stop + 1))] * 2

    resumed = f"{folder}/resumed"
    argv = base_argv(corpus, f"{folder}/cache", **FLAGS, **{"--save": save, "--save-interval": 1000,
                                                               "--load": save})
    codes, log = _run(launch, argv, resumed)
    assert set(codes) == {0}, log[-3000:]
    assert f"training from iteration {stop} to {ITERS}" in log
    second = _histories(resumed)
    for rank in range(2):
        assert first[rank] + second[rank] == straight[rank]  # exact: losses, grad norms
    assert len({h["losses"]["lm loss"] for h in straight[0]}) == ITERS  # dropout was on


# Tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_sigterm_to_the_launchers_process_group_saves_once_and_resumes_bit_for_bit(
        corpus, tmp_path, straight, launcher):
    if launcher == "deepspeed":
        pytest.importorskip("deepspeed")
    launch = {"torchrun": _torchrun, "deepspeed": _deepspeed}[launcher]
    folder = str(tmp_path)
    argv = base_argv(corpus, f"{folder}/cache", **FLAGS,
                     **{"--save": f"{folder}/ckpt", "--save-interval": 1000})
    (agent,) = procs = launch(argv, folder)
    _wait_for_log(folder, SIGNAL_AFTER, procs)
    ranks = [pid for pid in _children(agent.pid) if RECORDED in _cmdline(pid)]
    tree = {rank: _children(rank) for rank in ranks}
    assert len(tree) == 2 and all(len(w) >= 2 for w in tree.values()), tree  # the workers
    os.killpg(agent.pid, signal.SIGTERM)  # what a job's supervisor does
    _wait(procs)
    log = _first_log(folder)
    # The launcher itself exits non-zero after a signal (torchrun re-raises it, deepspeed's
    # exits 1), and sends its ranks a SIGTERM of its own; the ranks must have finished by
    # themselves, not been killed after its shutdown timeout.
    assert "Unable to shutdown process" not in log and "ChildFailedError" not in log
    _check_interrupted_then_resume(corpus, folder, launch, log, straight)


def test_sigterm_to_every_process_of_every_slurm_task_saves_once_and_resumes_bit_for_bit(
        corpus, tmp_path, straight):
    folder = str(tmp_path)
    argv = base_argv(corpus, f"{folder}/cache", **FLAGS,
                     **{"--save": f"{folder}/ckpt", "--save-interval": 1000})
    procs = _srun(argv, folder)
    _wait_for_log(folder, SIGNAL_AFTER, procs)
    tasks = [[*_children(task.pid), task.pid] for task in procs]  # each task's workers, rank
    assert all(len(pids) >= 3 for pids in tasks), tasks
    for pids in reversed(tasks):  # task 1 first, workers before ranks; task 0 a moment later
        for pid in pids:
            _kill(pid, signal.SIGTERM)
        time.sleep(0.05)
    codes = _wait(procs)
    log = _first_log(folder)
    assert codes == [0, 0], log[-3000:]
    _check_interrupted_then_resume(corpus, folder, _srun, log, straight)


BIG_MODEL = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8,
             "--micro-batch-size": 1, "--global-batch-size": 1}  # ~150 MB per checkpoint


def test_second_sigterm_during_the_exit_save_leaves_a_complete_checkpoint(corpus, tmp_path):
    folder, save = str(tmp_path), str(tmp_path / "ckpt")
    argv = base_argv(corpus, f"{folder}/cache", **BIG_MODEL, **{
        "--train-iters": 1000, "--lr-decay-iters": 1000, "--num-workers": 2,
        "--exit-signal-handler": True, "--save": save, "--save-interval": 1000})
    procs = [_popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv],
                    f"{folder}/task0.log", _env(f"{folder}/history"))]
    _wait_for_log(folder, re.compile(r"^ iteration +1/", re.M), procs)
    os.killpg(procs[0].pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while not (os.path.isdir(save) and any(".tmp-" in d for d in os.listdir(save))):
        if procs[0].poll() is not None and read_tracker(save) is not None:
            pytest.skip("the save finished before it was seen in progress")
        assert time.monotonic() < deadline and procs[0].poll() is None, _first_log(folder)
        time.sleep(0.001)
    os.killpg(procs[0].pid, signal.SIGTERM)  # while the checkpoint is being written
    codes = _wait(procs)
    log = _first_log(folder)
    assert codes == [0], log[-3000:]
    stop = int(EXITED.search(log).group(1))
    assert read_tracker(save).iteration == stop and list_iterations(save) == [stop]
    assert not [d for d in os.listdir(save) if ".tmp-" in d]
    state = torch.load(f"{save}/iter_{stop:07d}/mp_rank_00/model_optim_rng.pt",
                       weights_only=True)
    assert state["iteration"] == stop and state["optimizer"] and state["model"]

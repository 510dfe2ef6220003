"""A real SLURM (tests/slurm_cluster.py: slurmctld, slurmd and munge on this machine, one node
of 2 CPUs) runs examples/slurm/pretrain_gpt_slurm.sh as users submit it, at toy size:

- an uninterrupted job trains 2 tasks (srun) and saves;
- the same job preempted as SLURM signals a job at its time limit with ``--signal=B:TERM@N``
  (``scancel --signal=TERM --batch``: SIGTERM to the batch script only; the script passes it
  to every task through SLURM) saves one checkpoint and ends COMPLETED with exit code 0;
- ``scontrol requeue`` runs it again (``#SBATCH --requeue``, appending to its log): it resumes
  from that checkpoint, and every iteration's loss and grad norm, before and after the
  preemption, equal the uninterrupted job's.

Skips, saying why, where SLURM cannot run (.ci/run installs slurm-wlm and munge).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.dist_utils import free_port
from tests.distributed.training_utils import REPO, build_small_corpus, parse_log_lines
from tests.slurm_cluster import SlurmUnavailable, start_cluster

pytestmark = pytest.mark.slow
ITERS = 150
SCRIPT = str(REPO / "examples" / "slurm" / "pretrain_gpt_slurm.sh")
# The example's #SBATCH lines ask for 2 nodes of 8 GPUs; this cluster has one node of 2 CPUs.
SBATCH = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
          "--time=10"]
EXITED = re.compile(r"exiting at iteration (\d+) \(SIGTERM received with "
                    r"--exit-signal-handler\); checkpoint saved")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        cluster = start_cluster(str(tmp_path_factory.mktemp("slurm")))
    except SlurmUnavailable as error:
        pytest.skip(f"no SLURM here: {error}")
    yield cluster
    cluster.stop()


def _submit(cluster, corpus: dict, folder: str) -> str:
    tok = corpus["tokenizer_flags"]
    vocab, merges = tok[tok.index("--vocab-file") + 1], tok[tok.index("--merge-file") + 1]
    flags = ["--use-cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
             "4", "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
             "--lr-decay-iters", str(ITERS), "--hidden-dropout", "0.1", "--log-interval", "1",
             "--eval-iters", "0", "--eval-interval", "1000", "--save-interval", "1000",
             "--split", "98,2,0", "--num-workers", "0", "--tokenizer-type", "GPT2BPETokenizer",
             "--data-cache-path", f"{folder}/../cache"]
    return cluster.sbatch(*SBATCH, f"--output={folder}/job.out", f"--chdir={REPO}", SCRIPT,
                          f"{folder}/ckpt", vocab, merges, corpus["prefix"], *flags,
                          TP="1", PRECISION="fp32", MASTER_PORT=str(free_port()),
                          OMP_NUM_THREADS="1")


def _log(folder: str) -> str:
    path = f"{folder}/job.out"
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def _curve(log: str) -> dict[int, tuple[float, float]]:
    """(lm loss, grad norm) by iteration; an iteration logged twice must agree with itself."""
    curve: dict[int, tuple[float, float]] = {}
    for line in parse_log_lines(log):
        value = (line["lm loss"], line["grad norm"])
        assert curve.setdefault(line["iteration"], value) == value, line
    return curve


def _wait_for_iteration(cluster, job: str, folder: str, iteration: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        done = [line["iteration"] for line in parse_log_lines(_log(folder))]
        if done and max(done) >= iteration:
            return
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), _log(folder)[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"iteration {iteration} not reached:\n{_log(folder)[-3000:]}")


def test_sbatch_preempt_and_requeue_resume_with_the_uninterrupted_losses(cluster, tmp_path):
    corpus = build_small_corpus(str(tmp_path / "corpus"))
    straight, preempted = str(tmp_path / "straight"), str(tmp_path / "preempted")
    for folder in (straight, preempted):
        os.makedirs(folder)

    job = _submit(cluster, corpus, straight)
    state = cluster.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), _log(straight)[-3000:]
    reference = _curve(_log(straight))
    assert sorted(reference) == list(range(1, ITERS + 1))

    job = _submit(cluster, corpus, preempted)
    _wait_for_iteration(cluster, job, preempted, 5)
    cluster.run("scancel", "--signal=TERM", "--batch", job)
    state = cluster.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    first = _log(preempted)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), first[-3000:]
    stop = int(EXITED.search(first).group(1))
    assert 5 <= stop < ITERS, first[-3000:]
    assert "SIGTERM: every task saves a checkpoint and stops" in first
    assert "Traceback" not in first and "Killed" not in first, first[-3000:]

    cluster.requeue(job)
    state = cluster.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    log = _log(preempted)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{state}\n{log[-3000:]}\n{cluster.logs()}"
    assert log.startswith(first)  # --open-mode=append: the requeued run adds to the same log
    assert f"training from iteration {stop} to {ITERS}" in log[len(first):]
    assert _curve(log) == reference

#!/usr/bin/env python
"""kill -9 under ``torchrun --max-restarts``: does every restart resume and end on the
uninterrupted run's losses?

    python benchmarks/torchrun_restarts.py                     # 10 tries, static and c10d
    python benchmarks/torchrun_restarts.py --tries 3 --rdzv c10d --nodes 2 --seed 7
    python benchmarks/torchrun_restarts.py --max-restarts 1 --rdzv static   # one restart each

First one uninterrupted run of ``pretrain_gpt.py`` (2 processes, tensor parallel 2, dropout
on, a checkpoint every few iterations, synthetic data), then, per try, the same command under
``torchrun --max-restarts 3`` with ``--load`` on its ``--save``, and one worker (rank 0 or 1,
drawn at random) killed with SIGKILL at a random moment: during a training step (a random
delay after a random iteration's log line) or during a checkpoint save (as soon as the save's
temporary folder appears after a random iteration). A try passes when torchrun exits 0, the
restarted attempt resumed from a checkpoint (its "training from iteration N" line), every
logged loss of every attempt equals the uninterrupted run's at that iteration, and the last
attempt's per-iteration losses and grad norms equal the uninterrupted run's bit for bit
(``tests/distributed/pretrain_recorded.py`` writes them). ``--nodes 2`` starts two torchrun
agents of one process each on this machine, as two nodes would (their restart counts can then
differ: see ``megatron/platform/rendezvous.py``). Prints one line per try and the tally; it is a
measurement of the fault path, not a unit test (``tests/functional/test_torchrun_restarts.py``
runs two tries in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
RECORDED = os.path.join(REPO, "tests", "distributed", "pretrain_recorded.py")
ITERS = 60
SAVE_INTERVAL = 5
_LOG_LOSS = re.compile(r"^ iteration +(\d+)/ *\d+ \|.*?\| lm loss: (\S+) \|", re.M)
_RESUMED = re.compile(r"training from iteration (\d+) to")


def model_flags(save: str, iters: int = ITERS, save_interval: int = SAVE_INTERVAL,
                num_workers: int = 2) -> list[str]:
    """A tiny GPT at tensor parallel 2 (both ranks write checkpoint files), dropout on (the
    random states must resume too), synthetic data read by ``num_workers`` DataLoader workers
    per rank (pretrain_gpt.py's default: they are forked after rank 0 takes the --save lock),
    a checkpoint every ``save_interval``."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1",
        "--eval-iters", "0", "--mock-data", "--vocab-size", "512",
        "--tensor-model-parallel-size", "2", "--use-cpu", "--seed", "1234",
        "--save", save, "--load", save, "--save-interval", str(save_interval),
        "--num-workers", str(num_workers),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(history: str) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    os.makedirs(history, exist_ok=True)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "MEGATRON_TEST_HISTORY": history, "PYTHONPATH": REPO}


def launch(folder: str, flags: list[str], rdzv: str = "static", nodes: int = 1,
           max_restarts: int = 3) -> list[subprocess.Popen]:
    """torchrun agents (one per node, ``2 // nodes`` processes each), each in a session of
    its own, logging to ``folder/node{N}.log``."""
    port = free_port()
    os.makedirs(folder, exist_ok=True)
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
               "--nproc-per-node", str(2 // nodes), "--max-restarts", str(max_restarts),
               "--monitor-interval", "0.1"]
        if rdzv == "static":
            cmd += ["--rdzv-backend", "static", "--node-rank", str(node),
                    "--master-addr", "127.0.0.1", "--master-port", str(port)]
        else:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", f"restarts-{port}"]
        with open(f"{folder}/node{node}.log", "w") as out:
            procs.append(subprocess.Popen(
                [*cmd, RECORDED, *flags], stdout=out, stderr=subprocess.STDOUT,
                env=_env(f"{folder}/history"), cwd=REPO, start_new_session=True))
    return procs


def read_logs(folder: str) -> str:
    text = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".log"):
            with open(os.path.join(folder, name), errors="replace") as f:
                text.append(f.read())
    return "\n".join(text)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> Optional[list[int]]:
    """Exit codes, or None (and every process group killed) when ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        return [p.returncode for p in procs]
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_all(procs)


def kill_all(agents: list[subprocess.Popen]) -> None:
    """SIGKILL each agent still running and every process below it: torchrun starts its
    workers in sessions of their own, so killing the agent's group would leave them behind
    (a stopped one forever)."""
    for agent in agents:
        if agent.poll() is None:
            for pid in [*_descendants(agent.pid), agent.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            agent.wait()


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def histories(folder: str) -> list[list[dict]]:
    result = []
    for rank in range(2):
        with open(f"{folder}/history/rank{rank}.json") as f:
            result.append(json.load(f))
    return result


def run_uninterrupted(folder: str, timeout: float = 600, **shape) -> dict:
    """The reference: every rank's history and the logged losses (``shape``: model_flags'
    keywords)."""
    flags = model_flags(f"{folder}/ckpt", **shape)
    codes = wait_all(launch(folder, flags, max_restarts=0), timeout)
    log = read_logs(folder)
    if codes != [0]:
        raise RuntimeError(f"the uninterrupted run failed ({codes}):\n{log[-3000:]}")
    return {"histories": histories(folder), "logged": logged_losses(log)}


def logged_losses(log: str) -> dict[int, set]:
    """Every logged loss by iteration (several values where an attempt repeated it)."""
    found: dict[int, set] = {}
    for m in _LOG_LOSS.finditer(log):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return found


# Finding and killing a worker -------------------------------------------------------------


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (tests/distributed/test_preemption.py uses it
    too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _rank_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    rank = env.get(b"RANK")
    return int(rank) if rank is not None else None


def worker_pid(agents: list[subprocess.Popen], rank: int) -> Optional[int]:
    for agent in agents:
        for pid in children(agent.pid):
            if _rank_of(pid) == rank:
                return pid
    return None


@dataclasses.dataclass
class KillPlan:
    rank: int  # the global rank killed
    when: str  # "step" or "save"
    after_iteration: int  # the kill comes after this iteration's log line
    delay: float  # "step": seconds after that line


def draw_plan(rng: random.Random) -> KillPlan:
    when = rng.choice(("step", "save"))
    # Leave room after the kill: the last save before the end is at ITERS - SAVE_INTERVAL.
    after = rng.randrange(1, ITERS - 2 * SAVE_INTERVAL)
    return KillPlan(rng.randrange(2), when, after, rng.uniform(0.0, 0.3))


def _wait_for_iteration(folder: str, iteration: int, agents, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [int(i) for i, _ in _LOG_LOSS.findall(read_logs(folder))]
        if done and max(done) >= iteration:
            return True
        if any(a.poll() is not None for a in agents):
            return False
        time.sleep(0.02)
    return False


def _wait_for_save(save: str, agents, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.isdir(save) and any(".tmp-" in d for d in os.listdir(save)):
            return True
        if any(a.poll() is not None for a in agents):
            return False
        time.sleep(0.001)
    return False


def execute_kill(folder: str, plan: KillPlan, agents) -> str:
    """Kill the planned worker; returns what happened, for the report."""
    if not _wait_for_iteration(folder, plan.after_iteration, agents, 300):
        return "the run ended before the kill"
    if plan.when == "save":
        if not _wait_for_save(f"{folder}/ckpt", agents, 60):
            return "no save seen"
    else:
        time.sleep(plan.delay)
    pid = worker_pid(agents, plan.rank)
    if pid is None:
        return "worker not found"
    os.kill(pid, signal.SIGKILL)
    done = [int(i) for i, _ in _LOG_LOSS.findall(read_logs(folder))]
    return f"killed rank {plan.rank} during a {plan.when} after iteration {max(done)}"


# One try ---------------------------------------------------------------------------------


@dataclasses.dataclass
class TryResult:
    ok: bool
    what: str
    seconds: float


def check_try(folder: str, codes: Optional[list[int]], reference: dict) -> tuple[bool, str]:
    """Whether the killed run came back and ended on the uninterrupted run's losses."""
    log = read_logs(folder)
    if codes is None:
        return False, "hung (timed out)"
    if set(codes) != {0}:
        return False, f"torchrun exited {codes}: {_last_error(log)}"
    starts = [int(n) for n in _RESUMED.findall(log)]
    if len(starts) < 2:
        return False, f"no restart seen (attempts started at {starts})"
    resumed = starts[-1]
    logged = logged_losses(log)
    for iteration, values in logged.items():
        if values != reference["logged"].get(iteration):
            return False, f"iteration {iteration}: loss {values} != {reference['logged'].get(iteration)}"
    last = histories(folder)
    for rank in range(2):
        expected = reference["histories"][rank][resumed:]
        if last[rank] != expected:
            return False, f"rank {rank}: the last attempt's history differs from iteration {resumed + 1}"
    return True, f"resumed from iteration {resumed}, {len(starts) - 1} restart(s), losses equal"


def _last_error(log: str) -> str:
    lines = [line for line in log.splitlines() if "Error" in line or "error:" in line]
    return lines[-1][:300] if lines else log[-300:]


def run_try(folder: str, reference: dict, plan: KillPlan, rdzv: str, nodes: int,
            timeout: float = 600, max_restarts: int = 3, **shape) -> TryResult:
    start = time.monotonic()
    agents = launch(folder, model_flags(f"{folder}/ckpt", **shape), rdzv, nodes, max_restarts)
    what = execute_kill(folder, plan, agents)
    codes = wait_all(agents, timeout)
    ok, verdict = check_try(folder, codes, reference)
    return TryResult(ok, f"{what}: {verdict}", time.monotonic() - start)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--rdzv", choices=("static", "c10d", "both"), default="both")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="torchrun agents (one per simulated node)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2,
                        help="DataLoader workers per rank (0: none to orphan)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="torchrun-restarts-")
    print(f"runs in {root}", flush=True)
    reference = run_uninterrupted(f"{root}/uninterrupted", num_workers=args.num_workers)
    kinds = ("static", "c10d") if args.rdzv == "both" else (args.rdzv,)
    tally = {}
    for rdzv in kinds:
        passed = 0
        for n in range(args.tries):
            folder = f"{root}/{rdzv}-{n}"
            os.makedirs(folder)
            result = run_try(folder, reference, draw_plan(rng), rdzv, args.nodes,
                             max_restarts=args.max_restarts, num_workers=args.num_workers)
            passed += result.ok
            print(f"{rdzv} try {n + 1}: {'ok  ' if result.ok else 'FAIL'} "
                  f"{result.what} ({result.seconds:.0f} s)", flush=True)
        tally[rdzv] = passed
    for rdzv, passed in tally.items():
        print(f"{rdzv} rendezvous, {args.nodes} node(s): {passed}/{args.tries} kill -9 restarts "
              "resumed and ended with the uninterrupted run's losses")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(p == args.tries for p in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""megatron/platform/launcher_watch.py: a torchrun worker whose agent dies ends, by the kernel's
parent-death signal or, where that is not set, by its own check of the parent. Here the
"agent" is a small parent process killed with SIGKILL; tests/functional/test_torchrun_faults.py
kills a real torchrun agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron.platform import launcher_watch
from tests.processes import alive

REPO = Path(__file__).resolve().parents[2]

# The worker: watches its parent as a torchrun worker does; ``--no-pdeathsig`` leaves only
# the thread's check (as where prctl is missing).
WORKER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from megatron.platform import launcher_watch
    launcher_watch.POLL_SECONDS = 0.2
    if "--no-pdeathsig" in sys.argv:
        launcher_watch.set_parent_death_signal = lambda signum: False
    print(launcher_watch.stop_with_launcher(), flush=True)
    time.sleep(60)
""")
# The agent: starts the worker (its output to a file), says its pid, waits.
AGENT = textwrap.dedent("""
    import subprocess, sys
    out = open(sys.argv[1], "w")
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]],
                              stdout=out, stderr=subprocess.STDOUT)
    print(worker.pid, flush=True)
    worker.wait()
""")


def _run_and_kill_agent(tmp_path, *flags: str) -> tuple[float, str, int]:
    """Seconds the worker lived after its agent's SIGKILL, its output, the agent's pid."""
    log = tmp_path / "worker.log"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "RANK": "3"}
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(log),
                              WORKER.format(repo=str(REPO)), *flags],
                             stdout=subprocess.PIPE, text=True, env=env)
    worker = int(agent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not log.read_text().strip():  # it watches
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        assert int(log.read_text().split()[0]) == agent.pid
        agent.kill()
        agent.wait()
        killed = time.monotonic()
        while alive(worker) and time.monotonic() - killed < 20:
            time.sleep(0.05)
        lived = time.monotonic() - killed
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
    return lived, log.read_text(), agent.pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_kernel_stops_a_worker_whose_agent_is_killed(tmp_path):
    lived, out, _ = _run_and_kill_agent(tmp_path)
    assert lived < 2, out
    # SIGTERM at the agent's death, before the thread's check could see it and say so.
    assert out.split() == [out.split()[0]], out


def test_without_the_kernels_signal_the_worker_sees_its_agent_gone_and_stops(tmp_path):
    lived, out, agent = _run_and_kill_agent(tmp_path, "--no-pdeathsig")
    assert lived < 5, out
    assert (f"error: [rank 3] torchrun's agent (pid {agent}) is gone: this worker stops "
            "(SIGTERM, as the agent would send; nothing is left to restart the job)") in out
    assert "Traceback" not in out


def test_only_torchrun_workers_watch(monkeypatch):
    monkeypatch.setattr(launcher_watch, "_watching", None)
    assert launcher_watch.stop_with_launcher({}) is None  # a shell's child outlives the shell
    assert launcher_watch._watching is None

"""A real one-node SLURM cluster for tests: Debian's slurmctld and slurmd (package slurm-wlm)
with munge, started as root in a folder of their own, one node of 2 CPUs.

``start_cluster(folder)`` writes a munge key and a slurm.conf there (private ports, state and
logs in ``folder``), starts munged, slurmctld and slurmd, and returns a ``SlurmCluster`` once
the node is idle; ``stop()`` ends them. Where the machine cannot run them (slurm-wlm or munge
not installed, not root, a daemon that does not come up) it raises ``SlurmUnavailable``
saying why, and the tests skip with that reason. ``.ci/run`` installs the packages.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Optional

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel",
            "sinfo", "squeue")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster (the message says why)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(folder: str, node: str) -> str:
    return f"""ClusterName=megatron-test
SlurmctldHost={node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=30
JobRequeue=1
NodeName={node} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """The running daemons and the environment that points SLURM's commands at them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.env = {**os.environ, "SLURM_CONF": f"{folder}/slurm.conf"}
        self.daemons: list[subprocess.Popen] = []

    def run(self, *cmd: str, check: bool = True, **env: str) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              env={**self.env, **env})
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout}")
        return done.stdout

    def sbatch(self, *args: str, **env: str) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args, **env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
        fields = {}
        for word in self.run("scontrol", "show", "job", job_id, "--oneliner").split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not {states} after {timeout:.0f} s: {job}\n"
                             f"{self.logs()}")

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue``, then eligible (SLURM holds a requeued job about 2 minutes)
        after 2 s: slurmd refuses a job credential issued in the second its predecessor's
        was revoked ("Job credential revoked")."""
        self.run("scontrol", "requeue", job_id)
        time.sleep(2.0)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def logs(self) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = os.path.join(self.folder, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    tails.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancel what still runs (a failed test's job), then end the daemons."""
        if self.daemons and self.daemons[-1].poll() is None:
            self.run("scancel", "--user=root", "--full", check=False)
            deadline = time.monotonic() + 40
            while self.run("squeue", "--noheader", check=False).strip() and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()


def unavailable_reason() -> Optional[str]:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"slurm-wlm and munge are not installed ({', '.join(missing)} missing; "
                ".ci/run installs them with apt-get)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs, and this is not root"
    return None


def start_cluster(folder: str, timeout: float = 60.0) -> SlurmCluster:
    """munged, slurmctld and slurmd on this machine, one idle node of 2 CPUs."""
    reason = unavailable_reason()
    if reason:
        raise SlurmUnavailable(reason)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    os.chmod(folder, 0o755)  # munged wants a socket every user can reach
    node = socket.gethostname().split(".")[0]
    with open(os.path.join(folder, "slurm.conf"), "w") as f:
        f.write(_conf(folder, node))
    cluster = SlurmCluster(folder)
    key = os.path.join(folder, "munge.key")
    cluster.run("mungekey", "--create", "--keyfile", key)
    daemons = [
        ["munged", "--foreground", "--force", f"--socket={folder}/munge.socket",
         f"--key-file={key}", f"--pid-file={folder}/munged.pid",
         f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed"],
        ["slurmctld", "-D", "-i", "-f", f"{folder}/slurm.conf"],
        ["slurmd", "-D", "-f", f"{folder}/slurm.conf", "-N", node],
    ]
    try:
        for cmd in daemons:
            with open(os.path.join(folder, f"{cmd[0]}.out"), "w") as out:
                cluster.daemons.append(subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env,
                    start_new_session=True))
            time.sleep(0.5)
        _wait_idle(cluster, node, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_idle(cluster: SlurmCluster, node: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        dead = [d.args[0] for d in cluster.daemons if d.poll() is not None]
        if dead:
            raise SlurmUnavailable(f"{', '.join(dead)} exited at start-up:\n{cluster.logs()}")
        state = cluster.run("sinfo", "--noheader", "--format=%t", "--nodes", node,
                            check=False).strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise SlurmUnavailable(f"node {node} not idle after {timeout:.0f} s (state {state!r}):\n"
                           f"{cluster.logs()}")

"""A real one-node SLURM cluster for tests: examples/slurm/local_cluster.sh (the recipe README
gives users) starts Debian's slurmctld and slurmd (package slurm-wlm) with munge, as root, in a
folder of their own, one node of 2 CPUs.

``start_cluster(folder)`` runs the script's ``start`` and returns a ``SlurmCluster`` once the
node is idle; ``stop()`` runs its ``stop``. Where the machine cannot run them (slurm-wlm or
munge not installed, not root, a daemon that does not come up) it raises ``SlurmUnavailable``
saying why, and the tests skip with that reason. ``.ci/run`` installs the packages.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "local_cluster.sh"


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster (the message says why)."""


class SlurmCluster:
    """The running daemons and the environment that points SLURM's commands at them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.env = {**os.environ, "SLURM_CONF": f"{folder}/slurm.conf"}

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
        subprocess.run(["bash", str(SCRIPT), "stop", self.folder], capture_output=True,
                       text=True, timeout=120, env=self.env)


def start_cluster(folder: str, timeout: float = 60.0) -> SlurmCluster:
    """munged, slurmctld and slurmd on this machine, one idle node of 2 CPUs."""
    cluster = SlurmCluster(folder)
    try:
        done = subprocess.run(["bash", str(SCRIPT), "start", folder, "2"], capture_output=True,
                              text=True, timeout=timeout + 60,
                              env={**cluster.env, "SLURM_START_TIMEOUT": str(int(timeout))})
    except BaseException:
        cluster.stop()
        raise
    if done.returncode != 0:
        cluster.stop()
        raise SlurmUnavailable(done.stderr.strip() or done.stdout.strip())
    assert done.stdout.strip() == f"export SLURM_CONF={folder}/slurm.conf", done.stdout
    return cluster

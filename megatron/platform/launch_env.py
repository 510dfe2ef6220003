"""What the launcher says about this process: rank, world size and local rank from torchrun,
the deepspeed launcher or SLURM's srun; the rendezvous address where the launcher left it
unset; NCCL's error handling; the launching agent's own environment. Reads the environment
only: nothing here starts a process group."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Optional

from megatron.platform.slurm import slurm_rendezvous


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous nobody else named)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env(env: Optional[Mapping[str, str]] = None) -> dict[str, int]:
    """rank, world_size and local_rank from the launcher's environment (``os.environ`` by
    default; 1 process if no launcher)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return dict(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                    local_rank=int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return dict(rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
                    local_rank=int(env.get("SLURM_LOCALID", 0)))
    return dict(rank=0, world_size=1, local_rank=0)


def launched_by_srun(env: Mapping[str, str]) -> bool:
    """Whether srun started this process directly (not torchrun or deepspeed under srun)."""
    return not ("RANK" in env and "WORLD_SIZE" in env) and \
        "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def rendezvous_env(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT this process should use, where its launcher left them unset:
    under srun, the first host of the node list and a default port (``megatron.platform.slurm``);
    otherwise 127.0.0.1 and, for a world of one, a free port. Raises RuntimeError where a
    multi-process world has no port."""
    if launched_by_srun(env):
        try:
            return slurm_rendezvous(env)
        except ValueError as error:
            raise RuntimeError(str(error)) from None
    chosen = {"MASTER_ADDR": env.get("MASTER_ADDR") or "127.0.0.1"}
    if env.get("MASTER_PORT"):
        chosen["MASTER_PORT"] = env["MASTER_PORT"]
    elif distributed_env(env)["world_size"] > 1:
        raise RuntimeError("MASTER_PORT is not set: launch with torchrun, deepspeed or srun")
    else:
        chosen["MASTER_PORT"] = str(free_port())
    return chosen


# On a timeout NCCL's watchdog by default (3) and as torchrun sets it for its workers (1)
# aborts the communicators and takes the process down from its own thread, before the rank's
# one-line report (megatron/core/watchdog.py) can print. 2 ("clean up only") aborts them and
# leaves the error to the rank's own thread, which reports it and exits.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_CLEAN_UP_ONLY = "2"
TORCHRUN_NCCL_DEFAULT = "1"  # what torchrun's agent gives a worker when its own env has none


def nccl_error_handling_env(env: Mapping[str, str],
                            launcher_env: Optional[Mapping[str, str]]) -> dict[str, str]:
    """What to set before an NCCL group is made so that its timeouts reach our report: the
    clean-up-only mode, unless the user chose a mode (``env``: this process's; torchrun's own
    default for its workers, absent from ``launcher_env``, the agent's, is not a choice)."""
    chosen = [name for name in NCCL_ERROR_HANDLING if name in env]
    if chosen and not _torchrun_gave_it(env, launcher_env):
        return {}
    return {NCCL_ERROR_HANDLING[0]: NCCL_CLEAN_UP_ONLY}


def _torchrun_gave_it(env: Mapping[str, str], launcher_env: Optional[Mapping[str, str]]) -> bool:
    if not env.get("TORCHELASTIC_RUN_ID") or NCCL_ERROR_HANDLING[1] in env:
        return False
    if env.get(NCCL_ERROR_HANDLING[0]) != TORCHRUN_NCCL_DEFAULT:
        return False
    # The agent's environment tells whether the user set it; unreadable: take it as torchrun's.
    return launcher_env is None or NCCL_ERROR_HANDLING[0] not in launcher_env


def parent_env() -> Optional[dict[str, str]]:
    """The environment the parent process (torchrun's agent, for its workers) started with;
    None where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)

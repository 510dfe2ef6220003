"""SLURM's ``srun`` as a launcher: the rendezvous address from the job's node list.

``srun`` with one task per GPU sets, in every task, SLURM_PROCID (global rank), SLURM_NTASKS
(world size), SLURM_LOCALID (rank on the node) and the node list (SLURM_STEP_NODELIST,
SLURM_JOB_NODELIST) in SLURM's compressed form: ``gpu[001-008]``, ``a1,b2``,
``n[1-2,5],m7``. Rank 0 runs on the first host of the step (srun's default block
distribution), so that host is the rendezvous address every task can compute for itself:
no ssh, hostfile, ``scontrol`` or hand-set node rank is needed. The port is MASTER_PORT where
the user set one, else ``DEFAULT_MASTER_PORT``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

DEFAULT_MASTER_PORT = 6000  # Megatron's example scripts use this port
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

_PIECE = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: ``n[1-2,5],m7`` -> ``["n[1-2,5]", "m7"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    """``001-003,7`` -> ``["001", "002", "003", "7"]`` (zero padding kept, as SLURM does)."""
    names = []
    for item in spec.split(","):
        low, sep, high = item.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"node list {nodelist!r}: bad range {item!r} in [{spec}]")
        if not sep:
            names.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"node list {nodelist!r}: range {item!r} runs backwards")
        width = len(low)
        names += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return names


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (``r[1-2]n[1-2]``: 4 hosts)."""
    literals = _PIECE.split(pattern)  # text, range, text, range, ..., text
    choices = [[literals[i]] if i % 2 == 0 else _expand_range(literals[i], nodelist)
               for i in range(len(literals))]
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order (``scontrol show hostnames`` in Python)."""
    hosts = [host for pattern in _split_top_level(nodelist)
             for host in _expand_host(pattern, nodelist)]
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no host")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a node list, without expanding the rest."""
    return _expand_host(_split_top_level(nodelist)[0], nodelist)[0]


def slurm_rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for a task that srun started (``env``: its environment).

    Values already in ``env`` are kept; MASTER_ADDR otherwise comes from the first host of
    the step's (else the job's) node list. Raises ValueError when neither is there."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        name = next((n for n in NODELIST_VARIABLES if env.get(n)), None)
        if name is None:
            raise ValueError("srun task without MASTER_ADDR or SLURM_JOB_NODELIST: cannot "
                             "tell where rank 0 runs")
        try:
            addr = first_host(env[name])
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return {"MASTER_ADDR": addr, "MASTER_PORT": env.get("MASTER_PORT") or
            str(DEFAULT_MASTER_PORT)}

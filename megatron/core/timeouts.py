"""A communication that timed out, described in one line: the group, the operation and the
ranks that did not arrive.

Every process group carries ``--distributed-timeout-minutes`` (``parallel_state``; those
DeepSpeed's engine makes are adopted: ``parallel_state.adopt_groups``), so a rank
waiting for a peer that stopped, hung or died gets an error instead of waiting forever. On gloo
the error says only "Timed out waiting 6000ms for recv operation to complete"; this module
finds the rest:

- the operation and its group from torch's flight recorder (``_dump_fr_trace``: every
  collective of this process, with its group's name and description, its sequence number in
  that group and whether it finished; on by default) or, for pipeline point-to-point
  transfers, which gloo does not record there, from ``PointToPointTimeout`` raised by
  ``p2p_communication``;
- who did not arrive, from the other ranks: each rank whose own operation timed out writes
  what it was waiting in to the job's rendezvous store, and reads, for a short while, what the
  ranks of its group wrote. A rank of the group that is waiting in the same collective arrived;
  one waiting in something else, or silent (stopped, dead, or busy outside communication),
  did not.

On NCCL (GPUs) torch's watchdog notices the timeout itself: it prints the group, the
operation and its sequence number, dumps the flight recorder where ``TORCH_FR_DUMP_TEMP_FILE``
says, and takes the process down.
"""

from __future__ import annotations

import datetime
import json
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from megatron.core import parallel_state

_REPORT_KEY = "megatron/timed-out/{rank}"
# gloo's waits ("Timed out waiting 6000ms for recv operation to complete") and its pairs
# closed by one; NCCL's watchdog; a store wait.
_TIMEOUT_SIGNS = ("Timed out waiting", "timeout caused pair closure",
                  "collective operation timeout", "wait timeout after")


@dataclass(frozen=True)
class Pending:
    """An operation this rank was waiting in."""

    group_name: str  # torch's name of the group ("3")
    group_desc: str  # its description (TENSOR_MODEL_PARALLEL_GROUP)
    operation: str  # all_reduce, broadcast, recv from rank 1, ...
    seq: int  # collectives: the sequence number in the group; point-to-point: -1
    peers: tuple[int, ...] = ()  # point-to-point: the one rank it waits for

    def matches(self, other: Pending) -> bool:
        return self.group_name == other.group_name and self.seq == other.seq and self.seq >= 0

    def where(self) -> str:
        number = f" #{self.seq}" if self.seq >= 0 else ""
        return f"{self.operation}{number} on {self.group_desc or 'group ' + self.group_name}"


class PointToPointTimeout(RuntimeError):
    """A pipeline send or receive that waited past the group's timeout."""

    def __init__(self, pending: Pending, cause: BaseException) -> None:
        super().__init__(f"{pending.where()} timed out: {cause}")
        self.pending = pending


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a communication timeout."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, (PointToPointTimeout, TimeoutError, dist.DistStoreError)):
            return True
        if isinstance(error, RuntimeError) and any(sign in str(error)
                                                   for sign in _TIMEOUT_SIGNS):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def pending_operation(error: BaseException, entries: list[dict]) -> Optional[Pending]:
    """What this rank was waiting in when ``error`` was raised: the pipeline transfer that
    raised it, else the last collective it started (flight recorder ``entries``). gloo marks
    a timed-out collective finished like any other, but a rank waits on its collectives in
    order, so the last one started is the one that did not finish."""
    while error is not None:
        if isinstance(error, PointToPointTimeout):
            return error.pending
        error = error.__cause__ or error.__context__
    collectives = [e for e in entries if not e.get("is_p2p")]
    if not collectives:
        return None
    entry = max(collectives, key=lambda e: e.get("record_id", 0))
    name, desc = entry.get("process_group", ("?", ""))
    # A group made without a description (DeepSpeed's) is "undefined" to torch.
    desc = parallel_state.group_description(str(name)) or desc
    operation = str(entry.get("profiling_name", "collective")).split(":")[-1]
    return Pending(str(name), str(desc), operation, int(entry.get("collective_seq_id", -1)))


def flight_recorder_entries() -> list[dict]:
    """torch's record of this process's recent collectives (empty where there is none)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        return list(pickle.loads(_dump_fr_trace()).get("entries", []))
    except Exception:  # noqa: BLE001 - no flight recorder: the description says less
        return []


def positions(entries: list[dict]) -> dict[str, int]:
    """The sequence number of the last collective started in each group, by group name."""
    last: dict[str, int] = {}
    for e in entries:
        if not e.get("is_p2p"):
            name = str(e.get("process_group", ("?",))[0])
            last[name] = max(last.get(name, -1), int(e.get("collective_seq_id", -1)))
    return last


@dataclass(frozen=True)
class Report:
    """What a rank whose communication timed out tells the others."""

    pending: Optional[Pending]
    positions: dict[str, int]

    def to_json(self) -> str:
        return json.dumps({"pending": self.pending.__dict__ if self.pending else None,
                           "positions": self.positions})

    @staticmethod
    def from_json(text: str) -> Report:
        value = json.loads(text)
        pending = value["pending"]
        if pending is not None:
            pending = Pending(**{**pending, "peers": tuple(pending["peers"])})
        return Report(pending, value["positions"])


def exchange_reports(mine: Report, rank: int, ranks: list[int],
                     grace: float) -> Optional[dict[int, Optional[Report]]]:
    """Publish this rank's report; read what ``ranks`` published within ``grace`` seconds
    (None for a rank that published nothing). None when the store cannot be reached (for
    launchers other than torchrun it lives in rank 0, which may be the one that stopped)."""
    result: dict[str, Any] = {}

    def run() -> None:
        store = dist.distributed_c10d._get_default_store()
        store.set(_REPORT_KEY.format(rank=rank), mine.to_json())
        keys = {r: _REPORT_KEY.format(rank=r) for r in ranks if r != rank}
        deadline = time.monotonic() + grace
        # One request per poll, whatever the group's size: every rank of a large job may be
        # asking at the same moment.
        while keys and not store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(0.5)
        reports: dict[int, Optional[Report]] = {rank: mine}
        for r, key in keys.items():
            reports[r] = (Report.from_json(store.get(key).decode()) if store.check([key])
                          else None)
        result["reports"] = reports

    thread = threading.Thread(target=run, name="megatron-timeout-reports", daemon=True)
    thread.start()
    thread.join(grace + 5.0)
    return result.get("reports")


def describe_timeout(error: BaseException, during: str, grace: float = 30.0,
                     rank: Optional[int] = None) -> str:
    """One line: this rank, the operation, its group and members, when, who did not arrive.
    Waits up to ``grace`` seconds for the other ranks' reports."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    entries = flight_recorder_entries()
    pending = pending_operation(error, entries)
    timeout = parallel_state.group_timeout()
    after = f" after {timeout.total_seconds() / 60:g} min" if timeout is not None else ""
    if pending is None:
        return (f"[rank {rank}] a communication timed out{after} "
                f"(--distributed-timeout-minutes) during {during}: {_first_line(error)}")
    members = list(pending.peers) or parallel_state.group_members(pending.group_name) or []
    line = (f"[rank {rank}] {pending.where()}"
            f"{f' ({format_ranks(members)})' if members and not pending.peers else ''} timed out"
            f"{after} (--distributed-timeout-minutes) during {during}")
    reports = exchange_reports(Report(pending, positions(entries)), rank,
                               sorted({rank, *members}), grace)
    return f"{line}; {_absent(pending, members, rank, reports)}"


def _absent(pending: Pending, members: list[int], rank: int,
            reports: Optional[dict[int, Optional[Report]]]) -> str:
    others = [r for r in members if r != rank]
    if reports is None:
        return (f"ranks {others} did not answer through the rendezvous store (it may live in "
                "a stopped rank)")
    by_reason: dict[str, list[int]] = {}
    for r in others:
        if not _arrived(pending, reports.get(r)):
            by_reason.setdefault(_elsewhere(reports.get(r)), []).append(r)
    if not by_reason:
        return "every rank of the group arrived: the operation itself stalled"
    return "did not arrive: " + ", ".join(f"{format_ranks(ranks)} ({reason})"
                                          for reason, ranks in by_reason.items())


def format_ranks(ranks: list[int], most: int = 16) -> str:
    """``rank 3``, ``ranks 0-7, 12``; past ``most`` runs, ``... (N ranks)``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    if len(runs) > most:
        text += f", ... ({len(ranks)} ranks)"
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _arrived(pending: Pending, report: Optional[Report]) -> bool:
    if report is None or pending.peers:  # a silent rank; the peer of a transfer that stalled
        return False
    return report.positions.get(pending.group_name, -1) >= pending.seq


def _elsewhere(report: Optional[Report]) -> str:
    if report is None:
        return "no report: stopped, dead, or busy outside communication"
    if report.pending is None:
        return "its communication timed out too"
    return f"waiting in {report.pending.where()}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def default_grace(timeout: Optional[datetime.timedelta]) -> float:
    """How long a timed-out rank waits for the others' reports: as long as the timeout, at
    most 30 s (the others time out about when it did)."""
    seconds = timeout.total_seconds() if timeout is not None else 30.0
    return max(1.0, min(30.0, seconds))

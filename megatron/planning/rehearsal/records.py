"""What the rehearsal records: one ``CommOp`` per collective or point-to-point operation a rank
issues, in the order it issues them.

Groups are the global ranks of the process group, sorted; ``peer`` is the other rank of a
point-to-point operation (or the root of a broadcast, reduce, gather or scatter), as a global
rank. ``nbytes`` is the payload each rank hands to the library: the buffer of an all-reduce,
broadcast, send or receive, the gathered output of an all-gather, the full input of a
reduce-scatter (what the launch facts add up; a ring algorithm moves about (n-1)/n of it per
rank, twice for an all-reduce). An all-to-all given split sizes (the expert dispatch) also
keeps them, in the group's rank order: its members' inputs may differ in length, and what
must agree is that each sends every other what that one expects from it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Optional

P2P_OPS = ("send", "recv")  # the point-to-point operations; every other one is collective


@dataclasses.dataclass(frozen=True)
class CommOp:
    """One operation of one rank (see the module docstring)."""

    op: str
    group: tuple[int, ...]
    peer: Optional[int]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    detail: str  # reduce op (SUM, MAX, ...), "tag N" for point-to-point, the ranks of new_group
    site: str  # call site: innermost frames of our code, "path:line function < ..."
    phase: str  # "set-up" or "iteration"
    batch: int = 0  # point-to-point operations posted together share a number (0: alone)
    # All-to-all with split sizes: (rows sent to, rows received from) each group member.
    splits: tuple[tuple[int, ...], tuple[int, ...]] = ()

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS

    def key(self) -> tuple:
        """What members of a group must agree on (the call site and phase may differ; with
        split sizes, the rows each member hands an all-to-all)."""
        return (self.op, self.shape[1:] if self.splits else self.shape, self.dtype,
                self.detail, self.peer)

    def describe(self) -> str:
        """``op shape dtype [detail] at site``, for error messages."""
        parts = [self.op, "x".join(map(str, self.shape)) or "scalar", self.dtype]
        if self.detail:
            parts.append(self.detail)
        if self.peer is not None:
            parts.append(("to " if self.op == "send" else "from ") + str(self.peer)
                         if self.is_p2p else f"root {self.peer}")
        if self.splits:
            parts.append("rows to " + ",".join(map(str, self.splits[0])) + " from "
                         + ",".join(map(str, self.splits[1])))
        return " ".join(parts) + f" at {self.site}"

    def moved(self, rank_map: Callable[[int], int]) -> CommOp:
        """The same operation issued by the rank ``rank_map`` sends this one's rank to: every
        rank it names goes through ``rank_map`` (see ``megatron.planning.rehearsal.ranks``)."""
        if self.op == "new_group":
            return self  # every rank creates every group, in one order: nothing moves
        group = tuple(sorted(rank_map(r) for r in self.group))
        peer = None if self.peer is None else rank_map(self.peer)
        return dataclasses.replace(self, group=group, peer=peer,
                                   splits=moved_splits(self.splits, self.group, group, rank_map))


def moved_splits(splits: tuple, group: tuple[int, ...], moved: tuple[int, ...],
                 rank_map: Callable[[int], int]) -> tuple:
    """An all-to-all's split sizes in the order of the moved group (a translation may turn
    the order of its members)."""
    if not splits:
        return splits
    place = {r: i for i, r in enumerate(moved)}
    order = sorted(range(len(group)), key=lambda i: place[rank_map(group[i])])
    return tuple(tuple(sizes[i] for i in order) for sizes in splits)


def new_group_detail(ranks) -> str:
    return "ranks " + ",".join(map(str, ranks))


class SiteTable:
    """Interned call-site strings: many operations share a few sites."""

    def __init__(self) -> None:
        self._sites: dict[str, str] = {}

    def intern(self, text: str) -> str:
        return self._sites.setdefault(text, sys.intern(text))

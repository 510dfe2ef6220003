"""Do the ranks' operations fit together? The checks, in the order findings are reported:

1. alike ranks: in ``classes`` mode the last rank of each stage issues the first rank's
   operations moved to its own groups (``megatron.rehearsal.ranks``);
2. collectives: within every process group all members issue the same collectives in the
   same order, with the same shapes, dtypes, reduce ops and roots (``new_group`` calls
   count as collectives of the whole world: every rank must create every group, in order);
3. point to point: the k-th send from rank a to rank b with a tag matches the k-th receive
   at b from a with that tag, with the same shape and dtype;
4. nothing is left waiting: replaying every rank's operations in order, where a collective
   completes once all members reach it and a batch of sends and receives once each has its
   counterpart posted, every rank reaches its end (no hang);
5. every asynchronous operation a rank starts, it waits for.

A finding names the first diverging operation, the ranks, the group and each side's call
site.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

from megatron.rehearsal.ranks import RankGrid, RankPlan, group_kind
from megatron.rehearsal.records import CommOp


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str  # "alike", "collective", "point-to-point", "waiting", "unwaited"
    text: str
    position: int = 0  # where in the first rank's sequence (to report the earliest first)


class RankOps:
    """Every rank's operations (run ranks' own, other ranks' moved from their source), less
    those on groups whose members all issue one run rank's operations: such a group agrees
    with itself by construction (the alike check covers that construction), and its members
    advance together, so leaving it out changes neither check. That keeps a 1024-rank check
    to the pipeline, embedding, model and world groups' operations, a small share."""

    def __init__(self, plan: RankPlan, own: dict[int, list[CommOp]]) -> None:
        self.plan, self.own = plan, own
        self.groups = plan.grid.groups()
        self._single_source: dict[tuple[int, ...], bool] = {}

    def _kept(self, op: CommOp) -> bool:
        if op.is_p2p or op.op == "new_group":
            return True
        single = self._single_source.get(op.group)
        if single is None:
            single = len({self.plan.source[r] for r in op.group}) == 1 and len(op.group) > 1
            self._single_source[op.group] = single
        return not single

    def of(self, rank: int) -> list[tuple[int, CommOp]]:
        """(position in the rank's whole sequence, operation), for the operations kept."""
        source = self.plan.source[rank]
        if source == rank:
            return [(i, op) for i, op in enumerate(self.own[rank]) if self._kept(op)]
        move = self.plan.grid.mover(source, rank)
        out = []
        for i, op in enumerate(self.own[source]):
            if op.is_p2p or op.op == "new_group":
                out.append((i, op.moved(move)))
                continue
            group = tuple(sorted(move(r) for r in op.group))
            if self._kept(dataclasses.replace(op, group=group)):
                out.append((i, op.moved(move)))
        return out

    def kind(self, group: tuple[int, ...]) -> str:
        return group_kind(self.plan.grid, self.groups, group)


def _side(grid: RankGrid, rank: int, index: int, op: Optional[CommOp]) -> str:
    if op is None:
        return f"  {grid.describe(rank)}: nothing (it issued {index} operations there)"
    return f"  {grid.describe(rank)}: #{index} {op.describe()}"


def check_alike(ops: RankOps) -> list[Finding]:
    grid, findings = ops.plan.grid, []
    for first, last in ops.plan.checks:
        move = grid.mover(first, last)
        expected = [op.moved(move) for op in ops.own[first]]
        actual = ops.own[last]
        i = _first_difference([o.key() + (o.group,) for o in expected],
                              [o.key() + (o.group,) for o in actual])
        if i is None:
            continue
        stage = grid.coords(first)[0]
        findings.append(Finding("alike", "\n".join([
            f"the ranks of pipeline stage {stage} are not alike: the last one does not issue "
            f"the first one's operations in its own groups (rehearse with --rehearse-ranks "
            f"all to run every rank)",
            _side(grid, first, i, _at(ops.own[first], i)),
            _side(grid, last, i, _at(actual, i))]), i))
    return findings


def _at(seq: Sequence, i: int):
    return seq[i] if i < len(seq) else None


def _first_difference(a: Sequence, b: Sequence) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _by_group(ops: RankOps) -> dict[tuple[int, ...], dict[int, list[tuple[int, CommOp]]]]:
    """group -> member -> [(position in the member's sequence, op)], collectives only."""
    out: dict = defaultdict(dict)
    for rank in range(ops.plan.grid.world):
        for i, op in ops.of(rank):
            if not op.is_p2p:
                out[op.group].setdefault(rank, []).append((i, op))
    return out


def check_collectives(ops: RankOps) -> list[Finding]:
    grid, findings = ops.plan.grid, []
    for group, members in _by_group(ops).items():
        sequences = {r: members.get(r, []) for r in group}
        reference = group[0]
        ref = sequences[reference]
        for rank in group[1:]:
            seq = sequences[rank]
            i = _first_difference([o.key() for _, o in ref], [o.key() for _, o in seq])
            if i is None:
                continue
            position = min(ref[i][0] if i < len(ref) else 1 << 60,
                           seq[i][0] if i < len(seq) else 1 << 60)
            findings.append(Finding("collective", "\n".join([
                f"the {ops.kind(group)} group {_ranks(group)} diverges at its operation #{i}:",
                _side(grid, reference, i, _at([o for _, o in ref], i)),
                _side(grid, rank, i, _at([o for _, o in seq], i))]), position))
            break
    return findings


def _ranks(group: Sequence[int]) -> str:
    if len(group) > 8:
        return "[" + ", ".join(map(str, group[:4])) + f", ... {group[-1]}] ({len(group)} ranks)"
    return "[" + ", ".join(map(str, group)) + "]"


def _channels(ops: RankOps) -> tuple[dict, dict]:
    """(src, dst, detail) -> [(position, op)] for sends, and likewise for receives."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank in range(ops.plan.grid.world):
        for i, op in ops.of(rank):
            if op.op == "send":
                sends[(rank, op.peer, op.detail)].append((i, op))
            elif op.op == "recv":
                recvs[(op.peer, rank, op.detail)].append((i, op))
    return sends, recvs


def check_point_to_point(ops: RankOps) -> list[Finding]:
    grid, findings = ops.plan.grid, []
    sends, recvs = _channels(ops)
    for channel in sorted(set(sends) | set(recvs)):
        src, dst, detail = channel
        s, r = sends.get(channel, []), recvs.get(channel, [])
        i = _first_difference([(o.shape, o.dtype) for _, o in s],
                              [(o.shape, o.dtype) for _, o in r])
        if i is None:
            continue
        if i >= len(s):
            head = (f"{grid.describe(dst)} receives from rank {src} ({detail}) a message "
                    f"#{i} that is never sent:")
        elif i >= len(r):
            head = (f"{grid.describe(src)} sends to rank {dst} ({detail}) a message #{i} "
                    f"that is never received:")
        else:
            head = f"send #{i} from rank {src} to rank {dst} ({detail}) does not match its receive:"
        position = min(s[i][0] if i < len(s) else 1 << 60, r[i][0] if i < len(r) else 1 << 60)
        findings.append(Finding("point-to-point", "\n".join([
            head,
            _side(grid, src, i, _at([o for _, o in s], i)).replace(": #", ": send #"),
            _side(grid, dst, i, _at([o for _, o in r], i)).replace(": #", ": receive #")]),
            position))
    return findings


class _Replay:
    """Every rank's operations replayed with blocking semantics (see the module docstring)."""

    def __init__(self, ops: RankOps) -> None:
        self.world = ops.plan.grid.world
        self.steps = [self._steps([op for _, op in ops.of(r)]) for r in range(self.world)]
        self.at = [0] * self.world
        self.done_on = [defaultdict(int) for _ in range(self.world)]  # group -> collectives
        self.posted: dict = defaultdict(int)  # (kind, channel) -> operations posted
        self.posted_at: list[Optional[list[int]]] = [None] * self.world  # channel indices

    @staticmethod
    def _steps(seq: list[CommOp]) -> list[list[CommOp]]:
        steps: list[list[CommOp]] = []
        for op in seq:
            if op.is_p2p and steps and steps[-1][0].is_p2p and op.batch \
                    and steps[-1][0].batch == op.batch:
                steps[-1].append(op)
            else:
                steps.append([op])
        return steps

    def run(self) -> list[int]:
        """Advance until nothing moves; returns the ranks that did not reach their end."""
        moved = True
        while moved:
            moved = False
            for rank in range(self.world):
                while self.at[rank] < len(self.steps[rank]) and self._advance(rank):
                    moved = True
        return [r for r in range(self.world) if self.at[r] < len(self.steps[r])]

    def current(self, rank: int) -> Optional[list[CommOp]]:
        steps = self.steps[rank]
        return steps[self.at[rank]] if self.at[rank] < len(steps) else None

    def _advance(self, rank: int) -> bool:
        step = self.current(rank)
        if step[0].is_p2p:
            return self._p2p(rank, step)
        group = step[0].group
        k = self.done_on[rank][group]
        for member in group:
            other = self.current(member)
            if other is None or other[0].is_p2p or other[0].group != group \
                    or self.done_on[member][group] != k:
                return False
        for member in group:
            self.done_on[member][group] += 1
            self.at[member] += 1
        return True

    def _p2p(self, rank: int, step: list[CommOp]) -> bool:
        if self.posted_at[rank] is None:
            indices = []
            for op in step:
                key = self._key(rank, op)
                indices.append(self.posted[key])
                self.posted[key] += 1
            self.posted_at[rank] = indices
        for op, index in zip(step, self.posted_at[rank]):
            counterpart = self._counterpart(rank, op)
            if self.posted[counterpart] <= index:
                return False
        self.posted_at[rank] = None
        self.at[rank] += 1
        return True

    @staticmethod
    def _key(rank: int, op: CommOp) -> tuple:
        if op.op == "send":
            return ("send", rank, op.peer, op.detail)
        return ("recv", op.peer, rank, op.detail)

    @staticmethod
    def _counterpart(rank: int, op: CommOp) -> tuple:
        if op.op == "send":
            return ("recv", rank, op.peer, op.detail)
        return ("send", op.peer, rank, op.detail)


def check_waiting(ops: RankOps) -> list[Finding]:
    replay = _Replay(ops)
    stuck = replay.run()
    if not stuck:
        return []
    grid = ops.plan.grid
    lines = [f"{len(stuck)} rank(s) would wait forever (a hang): replaying every rank's "
             "operations in order, these cannot complete:"]
    for rank in stuck[:8]:
        step = replay.current(rank)
        lines.append(_side(grid, rank, replay.at[rank], step[0]).replace(": #", ": step #"))
    if len(stuck) > 8:
        lines.append(f"  ... and {len(stuck) - 8} more")
    return [Finding("waiting", "\n".join(lines), 1 << 59)]


def check_unwaited(grid: RankGrid, unwaited: dict[int, list[CommOp]]) -> list[Finding]:
    findings = []
    for rank, ops in sorted(unwaited.items()):
        if ops:
            findings.append(Finding("unwaited", "\n".join(
                [f"{grid.describe(rank)} started {len(ops)} asynchronous operation(s) it never "
                 "waited for; the first:", f"  {ops[0].describe()}"]), 1 << 60))
    return findings


def check(plan: RankPlan, own: dict[int, list[CommOp]],
          unwaited: dict[int, list[CommOp]]) -> list[Finding]:
    """Every finding, most telling first: a failed class check, then the earliest
    divergence of a group or a point-to-point channel, then hangs and unwaited requests."""
    ops = RankOps(plan, own)
    alike = check_alike(ops)
    if alike:
        return alike
    order = check_collectives(ops) + check_point_to_point(ops)
    order.sort(key=lambda f: f.position)
    return order + check_waiting(ops) + check_unwaited(plan.grid, unwaited)

"""Do the ranks' operations fit together? The checks, in the order findings are reported:

1. alike ranks: in ``classes`` mode the last rank of each stage issues the first rank's
   operations moved to its own groups (``megatron.planning.rehearsal.ranks``);
2. collectives: within every process group all members issue the same collectives in the
   same order, with the same shapes, dtypes, reduce ops and roots (``new_group`` calls
   count as collectives of the whole world: every rank must create every group, in order);
   an all-to-all with split sizes sends each member the rows that member expects;
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

from megatron.planning.rehearsal.ranks import RankGrid, RankPlan, group_kind
from megatron.planning.rehearsal.records import CommOp, moved_splits


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
        self._index: dict[int, dict] = {}
        self._kept_ops: dict[int, list[tuple[int, CommOp]]] = {}
        # Groups by number: a 1024-rank tuple is slow to hash, and each is hashed once here.
        self.group_of: list[tuple[int, ...]] = []
        self._ids: dict[tuple[int, ...], int] = {}
        self._by_object: dict[int, tuple[tuple[int, ...], int]] = {}

    def gid(self, group: tuple[int, ...]) -> int:
        """A small number for ``group`` (looked up by the tuple object first)."""
        hit = self._by_object.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        number = self._ids.get(group)
        if number is None:
            number = self._ids[group] = len(self.group_of)
            self.group_of.append(group)
        self._by_object[id(group)] = (group, number)
        return number

    def _kept_group(self, group: tuple[int, ...]) -> bool:
        kept = self._single_source.get(group)
        if kept is None:
            kept = len(group) <= 1 or len({self.plan.source[r] for r in group}) > 1
            self._single_source[group] = kept
        return kept

    def _by_source_group(self, source: int) -> dict[tuple[int, ...], list[int]]:
        """Positions of ``source``'s operations by group."""
        index = self._index.get(source)
        if index is None:
            index = defaultdict(list)
            for i, op in enumerate(self.own[source]):
                index[op.group].append(i)
            self._index[source] = index
        return index

    def of(self, rank: int) -> list[tuple[int, CommOp]]:
        """(position in the rank's whole sequence, operation), for the operations kept."""
        kept = self._kept_ops.get(rank)
        if kept is None:
            kept = self._kept_ops[rank] = self._of(rank)
        return kept

    def _of(self, rank: int) -> list[tuple[int, CommOp]]:
        source = self.plan.source[rank]
        own, world = self.own[source], self.plan.grid.world
        move = None if source == rank else self.plan.grid.mover(source, rank)
        positions, moved_groups = [], {}
        for group, where in self._by_source_group(source).items():
            moved = group if move is None or len(group) == world else \
                tuple(sorted(move(r) for r in group))
            moved_groups[group] = moved
            always = own[where[0]].is_p2p or own[where[0]].op == "new_group"
            if always or self._kept_group(moved):
                positions.extend(where)
        positions.sort()
        if move is None:
            return [(i, own[i]) for i in positions]
        out = []
        for i in positions:
            op = own[i]
            if op.op != "new_group":  # every rank creates every group: nothing moves
                moved = moved_groups[op.group]
                op = CommOp(op.op, moved, None if op.peer is None else move(op.peer),
                            op.shape, op.dtype, op.nbytes, op.detail, op.site, op.phase,
                            op.batch, moved_splits(op.splits, op.group, moved, move))
            out.append((i, op))
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
        i = _first_difference([o.key() + (o.group, o.splits) for o in expected],
                              [o.key() + (o.group, o.splits) for o in actual])
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


def _by_group(ops: RankOps) -> dict[int, dict[int, list[tuple[int, CommOp]]]]:
    """group number -> member -> [(position in the member's sequence, op)], collectives."""
    out: dict = defaultdict(dict)
    for rank in range(ops.plan.grid.world):
        for i, op in ops.of(rank):
            if not op.is_p2p:
                out[ops.gid(op.group)].setdefault(rank, []).append((i, op))
    return out


def check_collectives(ops: RankOps) -> list[Finding]:
    grid, findings = ops.plan.grid, []
    for number, members in _by_group(ops).items():
        group = ops.group_of[number]
        sequences = {r: members.get(r, []) for r in group}
        reference = group[0]
        ref = sequences[reference]
        ref_keys = [o.key() for _, o in ref]
        diverged = False
        for rank in group[1:]:
            seq = sequences[rank]
            i = _first_difference(ref_keys, [o.key() for _, o in seq])
            if i is None:
                continue
            position = min(ref[i][0] if i < len(ref) else 1 << 60,
                           seq[i][0] if i < len(seq) else 1 << 60)
            findings.append(Finding("collective", "\n".join([
                f"the {ops.kind(group)} group {_ranks(group)} diverges at its operation #{i}:",
                _side(grid, reference, i, _at([o for _, o in ref], i)),
                _side(grid, rank, i, _at([o for _, o in seq], i))]), position))
            diverged = True
            break
        if not diverged:
            findings += _check_splits(ops, group, sequences)
    return findings


def _check_splits(ops: RankOps, group: tuple[int, ...],
                  sequences: dict[int, list[tuple[int, CommOp]]]) -> list[Finding]:
    """The first all-to-all of ``group`` (its members' sequences agree already) in which a
    member sends another a number of rows other than that one expects from it."""
    grid = ops.plan.grid
    for i, (position, first) in enumerate(sequences[group[0]]):
        if not first.splits:
            continue
        for a, src in enumerate(group):
            sent = sequences[src][i][1].splits[0]
            for b, dst in enumerate(group):
                expected = sequences[dst][i][1].splits[1][a]
                if sent[b] != expected:
                    return [Finding("collective", "\n".join([
                        f"the all-to-all #{i} of the {ops.kind(group)} group {_ranks(group)} "
                        f"does not fit: rank {src} sends rank {dst} {sent[b]} rows, which "
                        f"expects {expected} from it:",
                        _side(grid, src, i, sequences[src][i][1]),
                        _side(grid, dst, i, sequences[dst][i][1])]), position)]
    return []


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
        self.ops = ops
        self.steps = [self._steps([op for _, op in ops.of(r)]) for r in range(self.world)]
        # A collective step's group number, beside the step.
        self.gids = [[None if step[0].is_p2p else ops.gid(step[0].group) for step in steps]
                     for steps in self.steps]
        self.at = [0] * self.world
        self.done_on = [defaultdict(int) for _ in range(self.world)]  # group -> collectives
        self.posted: dict = defaultdict(int)  # (kind, channel) -> operations posted
        self.posted_at: list[Optional[list[int]]] = [None] * self.world  # channel indices
        self.arrived = [False] * self.world  # at its current collective, counted
        self.arrivals: dict = defaultdict(int)  # (group, k) -> members at their k-th there
        self.waiting_peers: list[int] = []

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
        """Advance ranks as their operations complete; returns the ranks that did not reach
        their end. Each rank is looked at again only when a peer's progress may free it."""
        pending = list(range(self.world))
        while pending:
            rank = pending.pop()
            while self.current(rank) is not None:
                freed = self._advance(rank)
                if freed is None:
                    break
                pending.extend(freed)
        return [r for r in range(self.world) if self.at[r] < len(self.steps[r])]

    def current(self, rank: int) -> Optional[list[CommOp]]:
        steps = self.steps[rank]
        return steps[self.at[rank]] if self.at[rank] < len(steps) else None

    def _advance(self, rank: int) -> Optional[list[int]]:
        """Try ``rank``'s current step: None if it must wait, else the ranks to look at
        again (it completed; they may be waiting for it)."""
        step = self.current(rank)
        if step[0].is_p2p:
            return self._p2p(rank, step)
        group, number = step[0].group, self.gids[rank][self.at[rank]]
        key = (number, self.done_on[rank][number])
        if not self.arrived[rank]:
            self.arrived[rank] = True
            self.arrivals[key] += 1
        if self.arrivals[key] < len(group):
            return None
        for member in group:
            self.done_on[member][number] += 1
            self.at[member] += 1
            self.arrived[member] = False
        return [m for m in group if m != rank]

    def _p2p(self, rank: int, step: list[CommOp]) -> Optional[list[int]]:
        peers = [op.peer for op in step]
        if self.posted_at[rank] is None:
            indices = []
            for op in step:
                key = self._key(rank, op)
                indices.append(self.posted[key])
                self.posted[key] += 1
            self.posted_at[rank] = indices
            self.waiting_peers.extend(peers)  # a peer may be waiting for these
        for op, index in zip(step, self.posted_at[rank]):
            if self.posted[self._counterpart(rank, op)] <= index:
                freed, self.waiting_peers = self.waiting_peers, []
                return freed or None
        self.posted_at[rank] = None
        self.at[rank] += 1
        freed, self.waiting_peers = self.waiting_peers, []
        return freed + peers

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

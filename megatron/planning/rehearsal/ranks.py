"""The ranks of a launch, in Megatron's order (tensor fastest, then context, then data, then
pipeline), and which of them the rehearsal runs.

Ranks of one pipeline stage are alike: their tensor, context and data-parallel indices choose
which group each operation goes to and which values it carries, not which code runs. So a
rank ``(stage, replica r, tensor t)`` (``r = data index x context size + context index``)
issues the operations of ``(stage, 0, 0)`` with every rank they name moved by the same offsets
(``RankGrid.mover``: data index + d, context index + c, tensor index + t, modulo the sizes; a
translation of the grid that maps each tensor, context, data, pipeline, model and embedding
group onto another group of the same kind). Under expert parallelism (``ep``) a data index d
is (expert-data index d // ep, expert rank d % ep), and the two move separately, so expert
groups (runs of ep consecutive data indices) and expert-data groups (every ep-th) map onto
groups of their kinds too. In ``classes`` mode the rehearsal runs
the first rank of each stage and, to check that claim, the last rank (data d-1, tensor t-1)
of the first stage, of the last stage and of one middle stage (the middle stages run the same
code, a longer or shorter warm-up apart): the checker compares its operations with the first
rank's moved ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron.core.parallel_state import RankGroups, build_rank_groups


@dataclasses.dataclass(frozen=True)
class RankGrid:
    tp: int
    dp: int
    pp: int
    cp: int = 1  # context-parallel ranks of each replica
    ep: int = 1  # expert-parallel ranks: runs of ep consecutive data indices

    @property
    def replicas(self) -> int:
        """Ranks of a stage per tensor index: data x context."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.tp * self.replicas * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, replica index = data index x cp + context index, tensor index)."""
        per_stage = self.replicas * self.tp
        return rank // per_stage, (rank // self.tp) % self.replicas, rank % self.tp

    def rank(self, stage: int, r: int, t: int) -> int:
        return stage * self.replicas * self.tp + r * self.tp + t

    def describe(self, rank: int) -> str:
        stage, r, t = self.coords(rank)
        context = f", context {r % self.cp}" if self.cp > 1 else ""
        expert = f", expert {r // self.cp % self.ep}" if self.ep > 1 else ""
        return f"rank {rank} (stage {stage}, tensor {t}{context}, data {r // self.cp}{expert})"

    def mover(self, source: int, target: int) -> Callable[[int], int]:
        """The grid translation that sends ``source`` to ``target`` (same stage)."""
        s_stage, s_r, s_t = self.coords(source)
        t_stage, t_r, t_t = self.coords(target)
        if s_stage != t_stage:
            raise ValueError(f"ranks {source} and {target} hold different pipeline stages")
        ep, blocks = self.ep, self.dp // self.ep
        (sq, se), (tq, te) = divmod(s_r // self.cp, ep), divmod(t_r // self.cp, ep)
        dq, de, dc, dt = tq - sq, te - se, t_r % self.cp - s_r % self.cp, t_t - s_t

        def move(rank: int) -> int:
            stage, r, t = self.coords(rank)
            q, e = divmod(r // self.cp, ep)
            d = (q + dq) % blocks * ep + (e + de) % ep
            return self.rank(stage, d * self.cp + (r % self.cp + dc) % self.cp,
                             (t + dt) % self.tp)
        return move

    def groups(self) -> RankGroups:
        return build_rank_groups(self.world, self.tp, self.pp, self.cp, self.ep)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """Which ranks run (in this order) and whose operations every rank of the world has."""

    grid: RankGrid
    run: tuple[int, ...]
    source: tuple[int, ...]  # source[r]: the run rank whose operations rank r issues
    checks: tuple[tuple[int, int], ...]  # (first rank, last rank) of a stage, both run

    @property
    def derived(self) -> int:
        return self.grid.world - len(self.run)


def plan_ranks(grid: RankGrid, mode: str) -> RankPlan:
    """``all``: every rank runs. ``classes``: per stage its first rank, and the last rank of
    three stages (see the module docstring). Both run the last pipeline stage first (where the loss and the
    step's decisions come from; see ``megatron.planning.rehearsal.recorder``)."""
    run, checks = [], []
    source = list(range(grid.world))
    checked_stages = {0, min(1, grid.pp - 1), grid.pp - 1}
    for stage in reversed(range(grid.pp)):
        first, last = grid.rank(stage, 0, 0), grid.rank(stage, grid.replicas - 1, grid.tp - 1)
        if mode == "all":
            run.extend(grid.rank(stage, r, t) for r in range(grid.replicas)
                       for t in range(grid.tp))
            continue
        run.append(first)
        checked = last != first and stage in checked_stages
        if checked:
            run.append(last)
            checks.append((first, last))
        for replica in range(grid.replicas):
            for t in range(grid.tp):
                r = grid.rank(stage, replica, t)
                source[r] = last if checked and r == last else first
    return RankPlan(grid, tuple(run), tuple(source), tuple(checks))


GROUP_KINDS = ("tensor", "context", "data", "data_context", "pipeline", "embedding", "model",
               "expert", "expert_data")


def group_kinds(grid: RankGrid, groups: RankGroups, ranks: tuple[int, ...]) -> frozenset[str]:
    """Every kind of group ``ranks`` is (with two stages the embedding group is also the
    pipeline group; with expert parallel = data parallel the expert group is the data
    group): tensor, context, data, data x context, pipeline, embedding, model, expert and
    expert-data (under expert parallelism only), world."""
    members = list(ranks)
    kinds = {kind for kind in GROUP_KINDS if (grid.ep > 1 or not kind.startswith("expert"))
             and members in getattr(groups, kind)}
    if len(members) == grid.world and grid.world > 1:
        kinds.add("world")
    return frozenset(kinds)


def group_kind(grid: RankGrid, groups: RankGroups, ranks: tuple[int, ...]) -> str:
    """The group's name in messages: its first kind, else world or other."""
    kinds = group_kinds(grid, groups, ranks)
    for kind in (*GROUP_KINDS, "world"):
        if kind in kinds:
            return kind
    return "other"

"""Decentralized data parallelism: replicas average parameters with neighbours in a topology.

``--dp-mode decentralized``: no gradient is all-reduced over data parallel. Each replica
steps its optimizer on its own gradient, then averages its parameters with the members of its
group of this round (``ParameterGossip.average``); the groups of a round partition the
data-parallel ranks, and the rounds cycle. The topologies (``--dp-topology``) are those of
decent-dp, the library of "Pre-training GPT-2 on OpenWebText with Decentralized Training":

- ``complete``: every round, all ranks (with SGD, exactly all-reduce data parallelism);
- ``ring``: pairs ``(2i, 2i+1)``, then ``(2i+1, 2i+2)`` (mod n), alternately; n even;
- ``exp``: round k pairs rank j with ``j + 2^k`` (mod n), k = 0 .. log2(n) - 1; n a power of 2;
- ``alternating-exp-ring``: an average inside each node (its ``ranks_per_node`` consecutive
  data-parallel ranks), then an ``exp`` round between whole nodes (2 x ranks_per_node ranks
  together), alternately; the number of nodes a power of 2, at least 2.

With ``--dp-overlap`` the average of a round starts before the iteration's forward and
backward (``ParameterGossip.start_average``: asynchronous all-reduces of a flat copy of the
parameters) and is waited for just before the optimizer step (``PendingAverage.wait``).

Every weight is uniform inside a group (decent-dp's weights are too), so a round is one
all-reduce of the flattened parameters over the group, scaled by 1/size. Data-parallel rank
``i`` means the i-th rank of a data-parallel group; with tensor or pipeline parallelism every
(tensor, pipeline) position has its own data-parallel group and gets the same groups, built
over its own global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state

TOPOLOGIES = ("complete", "ring", "exp", "alternating-exp-ring")
Round = list[list[int]]  # a partition of the data-parallel ranks into groups


class TopologyError(ValueError):
    """The topology cannot be built for this data-parallel size; the message says why."""


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _exp_round(n: int, hop: int, block: int = 1) -> Round:
    """Blocks of ``block`` ranks; block j joins block j + hop (mod n blocks)."""
    used, groups = [False] * n, []
    for j in range(n):
        if not used[j]:
            partner = (j + hop) % n
            used[j] = used[partner] = True
            members = [b * block + r for b in sorted((j, partner)) for r in range(block)]
            groups.append(members)
    return groups


def topology_rounds(name: str, dp_size: int, ranks_per_node: int = 1) -> list[Round]:
    """The rounds of ``name`` over data-parallel ranks ``0 .. dp_size - 1``."""
    if name not in TOPOLOGIES:
        raise TopologyError(f"--dp-topology {name!r} is not one of {', '.join(TOPOLOGIES)}")
    n = dp_size
    if n == 1:
        return [[[0]]]
    if name == "complete":
        return [[list(range(n))]]
    if name == "ring":
        if n % 2:
            raise TopologyError(f"--dp-topology ring needs an even data-parallel size, got {n}")
        first = [[i, i + 1] for i in range(0, n, 2)]
        second = [sorted([i, (i + 1) % n]) for i in range(1, n, 2)]
        return [first, second] if n > 2 else [first]
    if name == "exp":
        if not _power_of_two(n):
            raise TopologyError(f"--dp-topology exp needs a power-of-2 data-parallel size, "
                                f"got {n}")
        return [_exp_round(n, 2 ** k) for k in range(n.bit_length() - 1)]
    return _alternating_exp_ring(n, ranks_per_node)


def _alternating_exp_ring(n: int, per_node: int) -> list[Round]:
    nodes = n // per_node if per_node >= 1 and n % per_node == 0 else 0
    if nodes < 2 or not _power_of_two(nodes):
        raise TopologyError(
            f"--dp-topology alternating-exp-ring needs a power-of-2 number (at least 2) of "
            f"nodes; this run has {n} data-parallel ranks, {per_node} per node "
            "(LOCAL_WORLD_SIZE / tensor-parallel size): use exp or ring on one node")
    inside = [list(range(b * per_node, (b + 1) * per_node)) for b in range(nodes)]
    rounds = []
    for k in range(nodes.bit_length() - 1):
        rounds += [inside, _exp_round(nodes, 2 ** k, per_node)]
    return rounds


class ParameterGossip:
    """Averages tensors over this rank's group of each round of a topology.

    Every rank of the world must build it with the same arguments (``new_group`` is
    collective): ``data_parallel_groups`` lists the global ranks of every data-parallel group
    (``parallel_state.build_rank_groups(...).data``); ``full_group`` is this rank's
    data-parallel process group (``average_all`` reduces over it).
    """

    def __init__(self, topology: str, data_parallel_groups: Sequence[Sequence[int]],
                 ranks_per_node: int = 1, *, full_group: Any) -> None:
        self.topology = topology
        dp_size = len(data_parallel_groups[0])
        self.rounds = topology_rounds(topology, dp_size, ranks_per_node)
        rank = dist.get_rank()
        mine = next(g for g in data_parallel_groups if rank in g)
        self.dp_rank = list(mine).index(rank)
        self.full_group, self.dp_size = full_group, dp_size
        self._groups = self._build_groups(data_parallel_groups, rank)

    def _build_groups(self, dp_groups, rank: int) -> list[tuple[Optional[Any], int]]:
        """(process group, size) of this rank in each round; None where it averages alone."""
        made: dict[tuple[int, ...], Any] = {}
        mine: list[tuple[Optional[Any], int]] = []
        for members_by_round in self.rounds:
            here = None
            for members in members_by_round:
                for dp_group in dp_groups:  # same order on every rank
                    ranks = tuple(dp_group[i] for i in members)
                    if len(ranks) > 1 and ranks not in made:
                        made[ranks] = parallel_state.new_group(ranks, "DATA_PARALLEL_GOSSIP_GROUP")
                    if rank in ranks:
                        here = (made.get(ranks), len(ranks))
            mine.append(here)
        return mine

    def num_rounds(self) -> int:
        return len(self.rounds)

    @torch.no_grad()
    def average(self, tensors: Sequence[torch.Tensor], round_index: int) -> None:
        """Replace each tensor by its mean over this rank's group of round ``round_index``."""
        group, size = self._groups[round_index % len(self._groups)]
        if size > 1:
            all_reduce_mean(tensors, group, size)

    @torch.no_grad()
    def start_average(self, tensors: Sequence[torch.Tensor],
                      round_index: int) -> PendingAverage:
        """Start averaging copies of ``tensors`` over this rank's group of round
        ``round_index`` (asynchronous collectives); the tensors themselves may change meanwhile.
        Every rank must ``wait()`` on the result before its next collective on the group."""
        group, size = self._groups[round_index % len(self._groups)]
        return PendingAverage(tensors, group if size > 1 else None, size)

    @torch.no_grad()
    def average_all(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the whole data-parallel group."""
        if self.dp_size > 1:
            all_reduce_mean(tensors, self.full_group, self.dp_size)


def all_reduce_mean(tensors: Sequence[torch.Tensor], group: Any, size: int) -> None:
    """In place: each tensor becomes its mean over ``group`` (one flat all-reduce per dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        flat.mul_(1.0 / size)  # scale first: gloo has no AVG
        dist.all_reduce(flat, group=group)
        for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(value)


class PendingAverage:
    """The mean of copies of some tensors over a group, being computed: one flat buffer per
    dtype, pre-scaled by 1/size (the copy of the values at the start), reduced asynchronously
    (``async_op=True``: on NCCL its own stream, ordered after the copy)."""

    def __init__(self, tensors: Sequence[torch.Tensor], group: Any, size: int) -> None:
        self._by_dtype: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self._works: list[Any] = []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            # a new buffer holding the values as of now (torch.cat always copies;
            # _flatten_dense_tensors returns a view of a lone tensor)
            flat = torch.cat([t.reshape(-1) for t in same])
            if group is not None:
                flat.mul_(1.0 / size)
                self._works.append(dist.all_reduce(flat, group=group, async_op=True))
            self._by_dtype.append((same, flat))

    @torch.no_grad()
    def wait(self, copy_into: bool = True) -> None:
        """Wait for the collectives; then (``copy_into``) each tensor given at the start
        becomes the group's mean of its value at the start."""
        for work in self._works:
            work.wait()
        self._works = []
        if not copy_into:
            return
        for same, flat in self._by_dtype:
            for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(value)

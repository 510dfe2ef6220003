"""The pipeline schedules' communication order, checked without processes.

Each stage's schedule runs here for real (autograd on tiny tensors) against a communicator
that records every exchange instead of sending. The recorded programs are then played
together under a rendezvous model stricter than any backend: a send completes only once its
receive is posted and a receive only once its send is, and an exchange returns when all its
operations completed. If the programs finish under this model, they cannot deadlock on gloo or
NCCL; with unit costs for compute the same play gives the schedule's ideal bubble, which must
equal the theory.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import bubble, schedules

SHAPE = (2, 1, 3)  # [s, b, h]


class RecordingCommunicator:
    """Stands in for P2PCommunicator: records ``("x", ops)`` items in ``program``."""

    def __init__(self, stage: int, num_stages: int, program: list) -> None:
        self.stage, self.num_stages, self.program = stage, num_stages, program
        self.is_first_stage = stage == 0
        self.is_last_stage = stage == num_stages - 1

    def exchange(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        nxt, prv = (self.stage + 1) % self.num_stages, (self.stage - 1) % self.num_stages
        ops = []
        if send_next is not None:
            assert send_next.shape == SHAPE
            ops.append(("send", nxt, "act"))
        if recv_prev:
            ops.append(("recv", prv, "act"))
        if send_prev is not None:
            assert send_prev.shape == SHAPE
            ops.append(("send", prv, "grad"))
        if recv_next:
            ops.append(("recv", nxt, "grad"))
        if ops:
            self.program.append(("x", ops))
        from_prev = torch.randn(SHAPE, requires_grad=True) if recv_prev else None
        from_next = torch.randn(SHAPE) if recv_next else None
        return from_prev, from_next


class _Tap(torch.autograd.Function):
    """Identity that records the backward pass of one chunk in the program."""

    @staticmethod
    def forward(ctx, x, program, cost):
        ctx.program, ctx.cost = program, cost
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.program.append(("c", ctx.cost, "B"))
        return grad, None, None


class ToyChunk(nn.Module):
    """A scalar-weight stage: records its forward and backward compute in the program."""

    def __init__(self, program: list, forward_cost: float, backward_cost: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.5))
        self.program, self.costs = program, (forward_cost, backward_cost)
        self.input_tensor = None

    def set_input_tensor(self, x):
        self.input_tensor = x

    def forward(self, data):
        x = data if self.input_tensor is None else self.input_tensor
        self.program.append(("c", self.costs[0], "F"))
        return _Tap.apply(x * self.w, self.program, self.costs[1])


def _forward_step(data_iterator, model):
    batch = next(data_iterator) if model.input_tensor is None else None  # first stage only
    out = model(batch)
    return out, lambda y: (y.sum(), {"lm loss": y.sum().detach()})


def record_stage_program(p: int, m: int, v: int, stage: int, forward_only: bool = False,
                         forward_cost: float = 1.0, backward_cost: float = 2.0) -> list:
    """Run one stage's schedule alone; return its program of compute items and exchanges
    (a micro-batch's forward through all v chunks costs ``forward_cost``)."""
    program: list = []
    chunks = [ToyChunk(program, forward_cost / v, backward_cost / v) for _ in range(v)]
    data = iter([torch.randn(SHAPE) for _ in range(m)])
    schedule = (schedules.forward_backward_pipelining_with_interleaving if v > 1
                else schedules.forward_backward_pipelining_without_interleaving)
    try:
        losses = schedule(forward_step_func=_forward_step, data_iterator=data,
                          model=chunks if v > 1 else chunks[0], num_microbatches=m,
                          forward_only=forward_only,
                          communicator=RecordingCommunicator(stage, p, program))
    finally:
        parallel_state.destroy_model_parallel()  # the schedule set a virtual rank
    assert len(losses) == (m if stage == p - 1 else 0)
    assert (next(data, None) is None) == (stage == 0), "the first stage reads all data"
    kinds = [item[2] for item in program if item[0] == "c"]
    assert kinds.count("F") == m * v
    assert kinds.count("B") == (0 if forward_only else m * v)
    return program


def record_programs(p: int, m: int, v: int, forward_only: bool = False) -> list[list]:
    """Every stage's program (see record_stage_program)."""
    return [record_stage_program(p, m, v, stage, forward_only) for stage in range(p)]


class Deadlock(AssertionError):
    pass


def _match_keys(programs: list[list]) -> list[list]:
    """Give every operation its message key (src, dst, tag, n): the n-th message from src to
    dst with that tag, counted on the sending and the receiving side alike."""
    counters: dict = defaultdict(int)
    keyed = []
    for rank, program in enumerate(programs):
        items = []
        for item in program:
            if item[0] == "x":
                ops = []
                for kind, peer, tag in item[1]:
                    src, dst = (rank, peer) if kind == "send" else (peer, rank)
                    n = counters[(kind, src, dst, tag)]
                    counters[(kind, src, dst, tag)] += 1
                    ops.append((kind, (src, dst, tag, n)))
                item = ("x", ops)
            items.append(item)
        keyed.append(items)
    sends = {key[1:]: n for key, n in counters.items() if key[0] == "send"}
    recvs = {key[1:]: n for key, n in counters.items() if key[0] == "recv"}
    assert sends == recvs, f"unmatched messages: sends {sends} vs receives {recvs}"
    return keyed


def play(programs: list[list]) -> tuple[list[float], list[float]]:
    """Run the programs together under the rendezvous model; returns each rank's finish time
    and compute time. Raises Deadlock if no rank can move and some have not finished."""
    keyed = _match_keys(programs)
    pos, clock = [0] * len(keyed), [0.0] * len(keyed)
    busy = [0.0] * len(keyed)
    posted: dict = {}  # (side, key) -> time the op was posted
    while any(pos[r] < len(keyed[r]) for r in range(len(keyed))):
        moved = False
        for r, items in enumerate(keyed):
            while pos[r] < len(items):
                item = items[pos[r]]
                if item[0] == "c":
                    clock[r] += item[1]
                    busy[r] += item[1]
                    pos[r] += 1
                    moved = True
                    continue
                for kind, key in item[1]:
                    posted.setdefault((kind, key), clock[r])
                partners = [posted.get(("recv" if kind == "send" else "send", key))
                            for kind, key in item[1]]
                if any(t is None for t in partners):
                    break
                clock[r] = max([clock[r], *partners])
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: keyed[r][pos[r]] for r in range(len(keyed)) if pos[r] < len(keyed[r])}
            raise Deadlock(f"no stage can move: {stuck}")
    return clock, busy


LAYOUTS = [(p, m, 1) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 13)]
LAYOUTS += [(p, m, v) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p, 4 * p)]
LAYOUTS += [(8, 8, 2), (8, 16, 2), (8, 24, 4)]


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "eval"])
@pytest.mark.parametrize("p,m,v", LAYOUTS)
def test_schedule_completes_under_rendezvous(p, m, v, forward_only):
    play(record_programs(p, m, v, forward_only))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (3, 7)])
def test_1f1b_ideal_bubble_matches_theory(p, m):
    finish, busy = play(record_programs(p, m, 1))
    simulated = 1.0 - (sum(busy) / p) / max(finish)
    assert simulated == pytest.approx(bubble.theoretical_bubble_fraction(p, m), rel=1e-12)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 2), (3, 6, 3), (4, 8, 4), (2, 4, 2)])
def test_interleaved_ideal_bubble_matches_theory(p, m, v):
    finish, busy = play(record_programs(p, m, v))
    simulated = 1.0 - (sum(busy) / p) / max(finish)
    assert simulated == pytest.approx(bubble.theoretical_bubble_fraction(p, m, v), rel=1e-12)


def test_interleaving_beats_1f1b():
    p, m = 4, 8
    plain = bubble.theoretical_bubble_fraction(p, m)
    assert bubble.theoretical_bubble_fraction(p, m, 2) < plain
    assert plain == pytest.approx(3 / 11)


def test_simulator_catches_a_deadlock():
    # Two stages that both receive before they send: the model must report it.
    a = [("x", [("recv", 1, "act")]), ("x", [("send", 1, "act")])]
    b = [("x", [("recv", 0, "act")]), ("x", [("send", 0, "act")])]
    with pytest.raises(Deadlock):
        play([a, b])


def test_1f1b_keeps_at_most_p_minus_stage_micro_batches_in_flight():
    p, m = 4, 8
    for stage, program in enumerate(record_programs(p, m, 1)):
        live = peak = 0
        for item in program:
            if item[0] == "c":
                live += 1 if item[2] == "F" else -1
                peak = max(peak, live)
        assert peak == p - stage


def test_interleaved_needs_micro_batches_multiple_of_stages():
    with pytest.raises(ValueError, match=r"micro-batches per iteration \(6\).*"
                                         r"--pipeline-model-parallel-size \(4\)"):
        record_programs(4, 6, 2)

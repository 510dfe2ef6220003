"""Run ranks of a launch one after another in this process, each over PyTorch's fake process
group (``torch.testing._internal.distributed.fake_pg``: a world of any size whose collectives
return at once), through the training code's own set-up and first iteration: a ``StartRank`` (given by
``megatron.training.rank_starter``: its ``start_run``) and ``Trainer.train``.

``run_rank`` is the part that does not care which backend the group has: a real gloo run of
the same command calls it too, so its records can be compared with the rehearsal's. Both route
mixture-of-experts tokens evenly (``routing``), so that communication sizes do not hang on
synthetic values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch.distributed as dist

from megatron.config import RunConfig
from megatron.core import parallel_state
from megatron.planning.rehearsal.memory import ActivationMeter, MeasuredMemory, state_bytes
from megatron.planning.rehearsal.ranks import RankPlan
from megatron.planning.rehearsal.recorder import Recorder, installed
from megatron.planning.rehearsal.records import CommOp
from megatron.planning.rehearsal.routing import balanced_routing
from megatron.platform.signals import ShutdownSignals

# (cfg, tokenizer, signals) -> the rank's trainer after its set-up (training.rank_starter).
StartRank = Callable[[RunConfig, Any, ShutdownSignals], Any]


@dataclasses.dataclass
class RankResult:
    """What one rank did: its operations in order, and what it held."""

    rank: int
    ops: list[CommOp]
    unwaited: list[CommOp]
    parameters: int
    memory: MeasuredMemory
    skipped_step: bool
    output: str = ""
    # Object collectives (broadcast_object_list, ...) whose sender had not been rehearsed
    # yet: this rank kept its own object (fake backend only).
    objects_not_received: int = 0


class RankFailure(Exception):
    """A rank's own code raised during its set-up or iteration (a finding of the rehearsal)."""

    def __init__(self, rank: int, phase: str, error: BaseException, output: str) -> None:
        self.rank, self.phase, self.error, self.output = rank, phase, error, output
        frames = traceback.extract_tb(error.__traceback__)
        ours = [f for f in frames if "/megatron/" in f.filename or f.filename.endswith(".py")
                and "site-packages" not in f.filename]
        where = ours[-1] if ours else (frames[-1] if frames else None)
        self.site = f"{where.filename}:{where.lineno} {where.name}" if where else "?"
        super().__init__(f"{type(error).__name__}: {error}")


def run_rank(cfg: RunConfig, tokenizer, start: StartRank, recorder: Recorder) -> RankResult:
    """This process's rank (its process group exists): set-up (``start``) and one iteration
    through the training code, recorded by ``recorder`` (which must be ``installed``), with
    balanced expert routing (``routing``)."""
    rank = dist.get_rank()
    out = io.StringIO()
    unknown_before = recorder.shared.unknown_objects
    with recorder.rank_scope(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out), balanced_routing():
        signals = ShutdownSignals(cfg.training.exit_signal_handler)
        try:
            trainer = start(cfg, tokenizer, signals)
            weights, grads, _ = state_bytes(trainer.chunks, trainer.optimizer)
            recorder.phase = "iteration"
            meter = ActivationMeter(trainer.chunks)
            with meter.measuring():
                trainer.train()
        except Exception as error:  # noqa: BLE001 - reported as the rehearsal's finding
            raise RankFailure(rank, recorder.phase, error, out.getvalue()) from error
        finally:
            signals.restore()
        optimizer = state_bytes(trainer.chunks, trainer.optimizer)[2]
        history = trainer.state.history
        skipped = bool(history and history[-1]["skipped"])
        parameters = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    return RankResult(rank, recorder.ops, recorder.unwaited(), parameters,
                      MeasuredMemory(weights, grads, optimizer, meter.peak), skipped,
                      out.getvalue(), recorder.shared.unknown_objects - unknown_before)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A fake process group in which this process is ``rank`` of ``world_size``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()



AroundRank = Callable[[int], contextlib.AbstractContextManager]


def run_planned_ranks(cfg: RunConfig, tokenizer, start: StartRank, plan: RankPlan,
                      progress: Optional[Callable[[int, RankResult], None]] = None,
                      around_rank: Optional[AroundRank] = None) -> list[RankResult]:
    """Every rank ``plan`` runs, in its order, each in a fresh fake world. ``around_rank``
    (tests only: no flag reaches it) gives a context each rank runs inside, given its rank;
    tests plant faults in one rank's code path with it."""
    recorder = Recorder()
    results = []
    with installed(recorder):
        for rank in plan.run:
            around = around_rank(rank) if around_rank is not None else contextlib.nullcontext()
            with fake_world(rank, plan.grid.world), around:
                result = run_rank(cfg, tokenizer, start, recorder)
            results.append(result)
            if progress is not None:
                progress(len(results), result)
    return results

"""The optimizer of ``--dp-mode decentralized``: a local step, then a neighbour average.

Wraps any ``MegatronOptimizer`` except the distributed one. The data-parallel wrapper does
not average gradients in this mode (``DistributedDataParallel(average_gradients=False)``), so
``step()`` updates this replica from its own gradient (clipped by its own norm; a step skipped
as non-finite on one replica is skipped on all), and then the
replica's parameters (fp32 main copies where there are any) are averaged over its group of
the round (``megatron/core/distributed/gossip.py``). With the ``complete`` topology and SGD
(momentum and weight decay included: they are linear in the gradient) this is the same
algorithm as all-reduce data parallelism.

``overlap=True`` (``--dp-overlap``) is decent-dp's overlapped update
``x_{t+1} = W_t x_t - lr * u(g(x_t))``: ``start_exchange()`` (the training loop calls it before
the iteration's forward and backward) starts averaging a copy of the parameters ``x_t`` of
this replica over its group of the round, while the gradient ``g(x_t)`` is computed;
``step()`` waits for it, puts the average in place of the parameters and applies the local
update there. The gradient is taken at the replica's own ``x_t``, not at the average, so even
with the ``complete`` topology this is not all-reduce data parallelism (there
``x_{t+1} = mean(x_t) - lr * mean(g)``); the replicas differ by their last local step.
An iteration that does not step (a NaN/Inf loss on some rank, every rank skips it) calls
``cancel_exchange()``: it waits and keeps ``x_t``, as the synchronous path does not average.

Checkpoints hold the average of the replicas: ``average_replicas()`` (the training loop calls
it on every rank before a save) replaces every replica's parameters and optimizer state by
their mean over the whole data-parallel group, and the run continues from there, so a run
resumed from that checkpoint continues exactly as the run that saved it. The number of rounds
done is saved with the optimizer state, so a resumed run is in the same round.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.core.distributed.gossip import ParameterGossip, PendingAverage
from megatron.core.optimizer.optimizer import MegatronOptimizer

ROUNDS_KEY = "decentralized_rounds_done"


class DecentralizedOptimizer:
    """``MegatronOptimizer``'s interface; everything but the methods below is the wrapped
    optimizer's own."""

    def __init__(self, inner: MegatronOptimizer, gossip: ParameterGossip,
                 overlap: bool = False) -> None:
        self.inner = inner
        self.gossip = gossip
        self.overlap = overlap
        self.rounds_done = 0
        self._pending: Optional[PendingAverage] = None
        # The gradient norm stays this replica's own, but a step skipped for an fp16 overflow
        # or a NaN/Inf gradient is skipped by every replica: else the skipping one's loss
        # scale and LR schedule fall behind the others'.
        inner.skip_agreement_groups = [gossip.full_group]

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def start_exchange(self) -> None:
        """With ``overlap``: start averaging this replica's parameters of now over its group
        of the round (before the forward and backward). Without: nothing."""
        if not self.overlap:
            return
        if self._pending is not None:
            raise RuntimeError("start_exchange() twice without a step() in between")
        self._pending = self.gossip.start_average(self.inner.get_main_params(),
                                                  self.rounds_done)

    def cancel_exchange(self) -> None:
        """An iteration that does not step: finish the exchange it started, keep x_t."""
        if self._pending is not None:
            self._pending.wait(copy_into=False)
            self._pending = None

    @torch.no_grad()
    def step(self) -> tuple[bool, Any, Any]:
        # A step skipped here (fp16 overflow, a NaN gradient) still averages: every replica
        # must join every round.
        if self.overlap:
            if self._pending is None:
                raise RuntimeError("--dp-overlap: step() without start_exchange() before the "
                                   "forward and backward")
            self._pending.wait()  # the main parameters are now the average of x_t
            self._pending = None
            result = self.inner.step()  # the local update, applied to the average
        else:
            result = self.inner.step()
            self.gossip.average(self.inner.get_main_params(), self.rounds_done)
        self.rounds_done += 1
        self.inner._copy_main_params_to_model_params()
        return result

    @torch.no_grad()
    def average_replicas(self) -> None:
        """Every replica's parameters and optimizer state become their mean over the whole
        data-parallel group (before a checkpoint is saved)."""
        self.cancel_exchange()  # none is under way between iterations; never leave one
        self.gossip.average_all(self.inner.get_main_params())
        state = [t for s in self.inner.state.values() for key, t in sorted(s.items())
                 if torch.is_tensor(t) and t.is_floating_point() and key != "step"]
        self.gossip.average_all(state)
        self.inner._copy_main_params_to_model_params()

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), ROUNDS_KEY: self.rounds_done}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.rounds_done = int(state_dict.pop(ROUNDS_KEY, 0))
        self.inner.load_state_dict(state_dict)

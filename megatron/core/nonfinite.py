"""The non-finite guard: a step whose loss or gradient norm is NaN/Inf is never applied.

With ``--check-for-nan-in-loss-and-grad`` (on by default, as in Megatron-LM), every iteration:

1. ``locate_nonfinite_loss`` checks every micro-batch's reported losses on every rank (one
   all-reduce of one integer). If any is NaN/Inf the optimizer is not called at all: no
   parameter, optimizer state or loss scale changes.
2. Otherwise the optimizer computes the global gradient norm and skips the update itself when
   that is NaN/Inf (``MegatronOptimizer.step``). An fp16 overflow stays the loss scaler's
   business (it backs the scale off and skips, as before); it is not counted here.
3. A skipped iteration is accounted as Megatron accounts any skipped one: the iteration count
   and consumed samples advance, the learning-rate schedule does not.
4. ``NonFiniteGuard`` counts such iterations in a row. Each one is logged with the iteration,
   the rank and micro-batch whose loss was non-finite (or "grad norm" and the ranks holding
   non-finite gradients), no checkpoint is saved at it, and after
   ``--max-consecutive-nonfinite-iterations`` in a row ``NonFiniteError`` stops the run (the
   latest checkpoint stays the last one saved at a finite iteration).

fp16 overflows are the loss scaler's: it skips the step and backs its scale off. When it can
back off no further (a static ``--loss-scale``, or a dynamic scale at ``--min-loss-scale``)
every step may be skipped for ever: ``OverflowGuard`` warns at each such iteration and stops
the run after ``--max-consecutive-nonfinite-iterations`` of them in a row, as the NaN guard
does.

``check_finite_for_save`` is the last line of defence: before every save every rank checks its
parameters, fp32 main copies and optimizer state, and a non-finite value anywhere stops the run
instead of being written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import ConfigError
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.optimizer import model_grad

# Keys of the loss all-reduce: rank * _MICRO_BATCHES + micro-batch; _NONE when all finite.
_MICRO_BATCHES = 1 << 20
_NONE = 1 << 62


class NonFiniteError(RuntimeError):
    """Training cannot go on: its losses, gradients or parameters are not finite."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _finite_per_micro_batch(losses: Sequence[dict[str, torch.Tensor]],
                            device: torch.device) -> torch.Tensor:
    """``[num_micro_batches]`` bool: every reported value of that micro-batch is finite."""
    finite = torch.ones(len(losses), dtype=torch.bool, device=device)
    for name in sorted({name for d in losses for name in d}):
        values = torch.stack([d[name].detach().to(device) for d in losses])  # [m, ...]
        finite &= torch.isfinite(values).reshape(len(losses), -1).all(dim=1)
    return finite


def locate_nonfinite_loss(losses: Sequence[dict[str, torch.Tensor]]) -> Optional[tuple[int, int]]:
    """``(rank, micro_batch)`` of the first NaN/Inf reported loss (the lowest global rank that
    has one, and its first such micro-batch), or None when every loss on every rank is finite.

    A collective over all ranks: every rank calls it every iteration (ranks without losses,
    e.g. pipeline stages before the last, pass an empty list).
    """
    return decode_nonfinite_loss_key(int(nonfinite_loss_key(losses).item()))


def nonfinite_loss_key(losses: Sequence[dict[str, torch.Tensor]],
                       group: Any = None) -> torch.Tensor:
    """``locate_nonfinite_loss``'s answer as a 1-element int64 tensor on the compute device,
    not yet read (an XLA step reads it after its graph ran): decode it with
    ``decode_nonfinite_loss_key``. A collective over all ranks (``group``: the default
    group's ranks in another group, as an XLA run's device groups are)."""
    device = parallel_state.get_default_device()  # what the collective can carry
    key = torch.full((1,), _NONE, dtype=torch.int64, device=device)
    if losses:
        bad = ~_finite_per_micro_batch(losses, device)
        first = torch.argmax(bad.to(torch.int64)).reshape(1)  # the first True
        key = torch.where(bad.any(), _rank() * _MICRO_BATCHES + first, key)
    if dist.is_initialized() and dist.get_world_size(group) > 1:  # (XLA SPMD: gloo, one rank)
        dist.all_reduce(key, op=dist.ReduceOp.MIN, group=group)
    return key


def nonfinite_loss_found(key: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: whether ``nonfinite_loss_key`` found a NaN/Inf loss anywhere."""
    return (key != _NONE).reshape(())


def decode_nonfinite_loss_key(value: int) -> Optional[tuple[int, int]]:
    """``(rank, micro_batch)`` from ``nonfinite_loss_key``'s value, or None (all finite)."""
    return None if value == _NONE else divmod(value, _MICRO_BATCHES)


def ranks_where(flag: bool) -> list[int]:
    """The global ranks on which ``flag`` is true. A collective over all ranks, sized by the
    world: meant for the rare paths that report a failure."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    flags = torch.zeros(world, dtype=torch.int32, device=parallel_state.get_control_device())
    flags[_rank()] = int(flag)
    if dist.is_initialized():
        dist.all_reduce(flags, group=parallel_state.get_control_group())
    return [rank for rank, value in enumerate(flags.tolist()) if value]


def grads_are_finite(chunks: Iterable[nn.Module]) -> bool:
    """Whether this rank's accumulated model gradients are all finite (local, no collective)."""
    grads = [g for chunk in chunks for p in chunk.parameters()
             if (g := model_grad(p)) is not None]
    return all(_all_finite(grads)) if grads else True


def _finite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds no NaN/Inf, as a 0-d bool tensor on its device. Its minimum and
    maximum carry any NaN and show any Inf, and cannot overflow; unlike a sum in fp64 (which
    on the CPU first copies an fp32 tensor to fp64) they need no temporary, so a background
    save's check of its host copy leaves the allocator holding nothing."""
    t = t.detach()
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _all_finite(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether it holds no NaN/Inf, with one host synchronisation."""
    if not tensors:
        return []
    device = tensors[0].device
    return torch.stack([_finite(t).to(device) for t in tensors]).tolist()


def _named_state_tensors(chunks: Sequence[nn.Module], optimizer: Any):
    """``(description, tensor)`` for every floating-point value a checkpoint would hold."""
    for i, chunk in enumerate(chunks):
        prefix = f"model chunk {i} " if len(chunks) > 1 else ""
        for name, p in unwrap_model(chunk).named_parameters():
            yield f"{prefix}parameter {name}", p
    model_params = {id(p) for chunk in chunks for p in chunk.parameters()}
    for i, main in enumerate(optimizer.get_main_params()):
        if id(main) not in model_params:
            yield f"fp32 main parameter {i} of the optimizer", main
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                yield f"optimizer state {key!r} of main parameter {i}", value


def first_nonfinite(chunks: Sequence[nn.Module], optimizer: Any) -> Optional[str]:
    """What the first NaN/Inf value of this rank's model or optimizer state is, or None."""
    return first_nonfinite_of(list(_named_state_tensors(chunks, optimizer)))


def first_nonfinite_of(named: Sequence[tuple[str, torch.Tensor]]) -> Optional[str]:
    """The description of the first of ``(description, tensor)`` whose tensor holds NaN/Inf
    (a background save checks its host copy with it), or None."""
    for (what, _), finite in zip(named, _all_finite([t for _, t in named])):
        if not finite:
            return what
    return None


def check_finite_for_save(chunks: Sequence[nn.Module], optimizer: Any, iteration: int) -> None:
    """Raise ``NonFiniteError`` on every rank if any rank's parameters or optimizer state hold
    NaN/Inf. A collective: every rank calls it before a save."""
    what = first_nonfinite(chunks, optimizer)
    ranks = ranks_where(what is not None)
    if not ranks:
        return
    box = [what]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=ranks[0], group=parallel_state.get_control_group())
    raise NonFiniteError(
        f"refusing to save the checkpoint of iteration {iteration}: {box[0]} on rank "
        f"{ranks[0]} holds NaN/Inf (non-finite values on ranks {_ranges(ranks)}); the latest "
        "checkpoint is unchanged")


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def describe_nonfinite_loss(rank: int, micro_batch: int, num_microbatches: int) -> str:
    return (f"the loss of micro-batch {micro_batch} (counted from 0, of {num_microbatches}) "
            f"on rank {rank}")


def describe_nonfinite_grad_norm(grad_norm: float, chunks: Sequence[nn.Module]) -> str:
    """A collective (every rank sees the same norm): which ranks hold non-finite gradients."""
    ranks = ranks_where(not grads_are_finite(chunks))
    where = f"; non-finite gradients on ranks {_ranges(ranks)}" if ranks else ""
    return f"the grad norm ({grad_norm}; every micro-batch loss was finite{where})"


@dataclasses.dataclass
class NonFiniteGuard:
    """Counts iterations in a row whose step was skipped as non-finite; words the log lines
    and the stop (see the module docstring)."""

    max_consecutive: int
    consecutive: int = 0
    first_iteration: Optional[int] = None  # of the current run of non-finite iterations

    def __post_init__(self) -> None:
        if self.max_consecutive < 1:
            raise ConfigError("--max-consecutive-nonfinite-iterations must be at least 1, got "
                              f"{self.max_consecutive}")

    def observe(self, iteration: int, source: Optional[str]) -> Optional[str]:
        """Record ``iteration``; ``source`` says what was non-finite (None: the step was
        finite). Returns the warning to log, or None."""
        if source is None:
            self.consecutive, self.first_iteration = 0, None
            return None
        self.consecutive += 1
        if self.first_iteration is None:
            self.first_iteration = iteration
        return (f"WARNING: iteration {iteration}: {source} is NaN/Inf; the step was skipped "
                f"(no update, no checkpoint at this iteration). {self.consecutive} in a row; "
                f"the run stops at {self.max_consecutive} "
                "(--max-consecutive-nonfinite-iterations).")

    @property
    def in_nonfinite_run(self) -> bool:
        """Whether the latest iteration was skipped as non-finite (no checkpoint then)."""
        return self.consecutive > 0

    @property
    def must_stop(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def stop_error(self, iteration: int, save_dir: Optional[str],
                   last_saved: Optional[int]) -> NonFiniteError:
        if save_dir is None:
            latest = "no --save given"
        elif last_saved is None:
            latest = f"this run saved no checkpoint in --save {save_dir}"
        else:
            latest = (f"the latest checkpoint in --save {save_dir} is iteration {last_saved}, "
                      "from before them")
        resume = (f"resume with --load {save_dir} --override-opt_param-scheduler and a lower "
                  "--lr (the flag lets the new --lr replace the checkpoint's schedule)"
                  if save_dir is not None and last_saved is not None
                  else "lower --lr")
        return NonFiniteError(
            f"{self.consecutive} iterations in a row ({self.first_iteration}-{iteration}) had a "
            f"NaN/Inf loss or grad norm and were skipped; stopping without saving ({latest}). "
            f"To go on: {resume}, look at the data of those iterations, or raise "
            "--max-consecutive-nonfinite-iterations.")


@dataclasses.dataclass
class OverflowGuard:
    """fp16: counts iterations in a row that the loss scaler skipped (an overflow) with a
    scale that could not back off: a static ``--loss-scale`` (``static_scale``), or a dynamic
    one already at ``--min-loss-scale`` when the step began. Skips while a dynamic scale is
    still backing off (the first iterations of most fp16 runs) are not counted."""

    max_consecutive: int
    static_scale: Optional[float]
    min_scale: float
    consecutive: int = 0
    first_iteration: Optional[int] = None
    scale: float = 0.0  # of the latest counted iteration

    def observe(self, iteration: int, overflowed: bool, scale: Optional[float]) -> Optional[str]:
        """Record ``iteration``: ``overflowed`` (the scaler skipped its step) with the loss
        ``scale`` it began with. Returns the warning to log, or None."""
        stuck = overflowed and scale is not None and (
            self.static_scale is not None or scale <= self.min_scale)
        if not stuck:
            self.consecutive, self.first_iteration = 0, None
            return None
        self.consecutive += 1
        self.scale = scale
        if self.first_iteration is None:
            self.first_iteration = iteration
        return (f"WARNING: iteration {iteration}: fp16 overflow; the loss scaler skipped the "
                f"step and {self._cannot_back_off()}. {self.consecutive} in a row; the run "
                f"stops at {self.max_consecutive} (--max-consecutive-nonfinite-iterations).")

    def _cannot_back_off(self) -> str:
        if self.static_scale is not None:
            return f"cannot back off: its scale is fixed at {self.scale:g} (--loss-scale)"
        return f"cannot back off: its scale is at the minimum, {self.scale:g} (--min-loss-scale)"

    @property
    def must_stop(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def stop_error(self, iteration: int) -> NonFiniteError:
        fix = ("Drop --loss-scale (dynamic loss scaling) or give a smaller one"
               if self.static_scale is not None else "Lower --lr or --min-loss-scale")
        return NonFiniteError(
            f"{self.consecutive} iterations in a row ({self.first_iteration}-{iteration}) "
            f"overflowed in fp16 and were skipped: the loss scaler {self._cannot_back_off()}, "
            f"so no update has been applied since iteration {self.first_iteration - 1}. "
            f"{fix}, or train with --bf16.")

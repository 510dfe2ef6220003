"""The distributed optimizer's state gathered to one data-parallel rank in bounded pieces.

A checkpoint in Megatron's ``torch`` format holds the optimizer state whole (independent of the
data-parallel size), written by data-parallel rank 0. ``DistributedOptimizer.
gathered_state_dict`` builds that whole state on *every* rank; a save does not need that.
Here instead:

- ``DistributedOptimizer.shard_snapshot()`` takes this rank's pieces of the main weights and
  optimizer state (host copies when asked, for a save written in the background) and what
  every rank needs to put the whole together (``ShardSnapshot.params``: for each parameter,
  which data-parallel rank owns which elements);
- ``gather_to_first(snapshot, ...)`` walks the parameters in a fixed order and, for each
  parameter and state key, gives data-parallel rank 0 the whole tensor: its own piece plus the
  pieces the other ranks send it (point-to-point). The other ranks only send. At most one
  parameter's tensor of one key is assembled at a time, so no process holds more than its own
  shard and a buffer of the largest parameter.

The tensors come in the order of ``ShardSnapshot.entries()``: the order of
``gathered_state_dict()['param_state']`` (chunk, then parameter in buffer order, then key),
so a file written from them equals one written from ``gathered_state_dict()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParamPieces:
    """Where one parameter's elements live: ``pieces`` are ``(dp_rank, lo, hi)`` ranges of
    the flattened parameter, ascending, covering it whole."""

    chunk: int
    name: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclasses.dataclass
class ShardSnapshot:
    """This data-parallel rank's share of the distributed optimizer's state.

    ``keys``: the state keys every parameter is saved with (``param``: the fp32 main weight,
    then e.g. ``exp_avg``, ``exp_avg_sq``); ``own[(chunk, name)][key]``: this rank's piece
    (1-D fp32, the elements of its ``pieces`` entry), missing state being zeros; the rest is
    the gathered state dict's small entries.
    """

    keys: list[str]
    step: Optional[float]
    param_groups: list[dict]
    grad_scaler: Optional[dict]
    num_chunks: int
    params: list[ParamPieces]
    own: dict[tuple[int, str], dict[str, torch.Tensor]]
    dp_rank: int
    dp_size: int

    def entries(self) -> Iterator[tuple[ParamPieces, str]]:
        """(parameter, key) in the order ``gather_to_first`` gives their tensors."""
        for param in self.params:
            for key in self.keys:
                yield param, key

    def own_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for piece in self.own.values()
                   for t in piece.values())


def gather_to_first(snapshot: ShardSnapshot, group: Any, dp_ranks: list[int],
                    device: torch.device) -> Iterator[torch.Tensor]:
    """On data-parallel rank 0: each (parameter, key) of ``snapshot.entries()`` as one whole
    tensor of the parameter's shape (fp32, on the CPU). On the other ranks: nothing (it sends
    this rank's pieces as rank 0 asks for them); every data-parallel rank must draw the
    iterator to its end, once (it empties ``snapshot.own`` as it goes). ``group`` carries the
    point-to-point messages (global ranks ``dp_ranks[r]`` for data-parallel rank ``r``);
    pieces travel on ``device``."""
    first = snapshot.dp_rank == 0
    for param in snapshot.params:
        for key in snapshot.keys:
            if first:
                yield _assemble(snapshot, param, key, group, dp_ranks, device)
            else:
                _send_own(snapshot, param, key, group, dp_ranks[0], device)
        # Sent or written: a host copy taken for a background save is freed as it goes.
        snapshot.own.pop((param.chunk, param.name), None)


def _assemble(snapshot: ShardSnapshot, param: ParamPieces, key: str, group: Any,
              dp_ranks: list[int], device: torch.device) -> torch.Tensor:
    whole = torch.zeros(param.numel, dtype=torch.float32, device=device)
    for rank, lo, hi in param.pieces:
        if rank == snapshot.dp_rank:
            whole[lo:hi].copy_(snapshot.own[(param.chunk, param.name)][key])
        else:
            received = whole[lo:hi]
            dist.recv(received, src=dp_ranks[rank], group=group)
    return whole.view(param.shape).cpu()


def _send_own(snapshot: ShardSnapshot, param: ParamPieces, key: str, group: Any, dst: int,
              device: torch.device) -> None:
    piece = snapshot.own.get((param.chunk, param.name))
    if piece is None:
        return
    dist.send(piece[key].to(device).contiguous(), dst=dst, group=group)

"""What one rehearsed rank holds, measured from its own objects (bytes, at the rehearsal's
size), to set beside the planner's figures for the same size.

- weights: every storage behind the model chunks' parameters, once;
- gradients: the data-parallel wrapper's gradient buffers;
- optimizer: the optimizer's state tensors (Adam's moments) and its main parameters where
  they are not the model's own (fp32 copies under fp16/bf16), after the step;
- activations: the peak, over the iteration, of the bytes autograd keeps for backward (each
  storage once; parameters excluded), from ``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    weights: int
    gradients: int
    optimizer: int
    activations: int


def _storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> int:
    seen, total = set(exclude), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _param_storages(chunks: Iterable[nn.Module]) -> set[int]:
    return {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}


def state_bytes(chunks: list[nn.Module], optimizer: Any) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes of one rank's chunks and optimizer."""
    params = [p for c in chunks for p in c.parameters()]
    weights = _storage_bytes(params)
    grads = _storage_bytes(b.grad_data for c in chunks for b in getattr(c, "buffers", []))
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in getattr(inner, "state", {}).values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    mains = optimizer.get_main_params() if hasattr(optimizer, "get_main_params") else []
    opt = _storage_bytes([*mains, *state], exclude=_param_storages(chunks))
    return weights, grads, opt


class ActivationMeter:
    """Peak bytes of the tensors autograd saves for backward, while ``measuring()``."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        self._params = _param_storages(chunks)
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.alive = self.peak = 0

    @contextmanager
    def measuring(self) -> Iterator[ActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0 or t.device.type == "meta":
            return t
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = storage.nbytes()
            self.alive += storage.nbytes()
            self.peak = max(self.peak, self.alive)
        self._refs[key] = self._refs.get(key, 0) + 1
        holder = _Saved(t)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.alive -= self._sizes.pop(key)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

"""The distributed optimizer: fp32 main weights and optimizer state sharded over data parallel.

Each model chunk is wrapped by ``DistributedDataParallel(use_distributed_optimizer=True)``,
whose buffers are split into buckets and every bucket into one contiguous slice per
data-parallel rank (``Bucket.shard_range``). This rank keeps fp32 main copies of, and
optimizer state for, only the pieces of parameters inside its slices. A step is:

1. the wrapper reduce-scatters gradients, so this rank's slices hold the averaged gradient;
2. unscale/check inf, clip (norm summed over model-parallel *and* data-parallel ranks), and
   step the torch optimizer on the main shards;
3. write the shards into the wrapper's flat parameter buffer and all-gather it per bucket,
   which updates every model parameter (they are views into that buffer).

Checkpoints (what ``megatron/checkpointing/`` calls):

- ``shard_snapshot()``: this rank's pieces and where every rank's pieces go; with
  ``shard_gather.gather_to_first`` data-parallel rank 0 receives the whole state one
  parameter at a time (what a checkpoint save uses: no rank holds more than its shard and one
  parameter's buffer).
- ``state_dict()`` / ``gathered_state_dict()``: a **collective over the data-parallel group**
  (every dp rank must call it). Returns the same, data-parallel-independent dict on every rank:
  full fp32 main weights and optimizer state per parameter, keyed by chunk index and parameter
  name, plus the param-group hyper-parameters and loss-scaler state. Save it from dp rank 0;
  ``load_state_dict()`` accepts it at **any** data-parallel size (also a collective, since it
  re-gathers the model parameters).
- ``sharded_state_dict()`` / ``load_sharded_state_dict()``: this rank's shard only, no
  communication; a checkpoint written this way loads only at the same data-parallel size and
  layout (checked, with an error that says so). ``load_state_dict`` also accepts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import ConfigError, OptimizerConfig
from megatron.core.collectives import all_gather_flat
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.core.optimizer.clip_grads import Groups, all_reduce_over
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    MegatronOptimizer,
    OptimizerFactory,
    _with_params,
    copy_param_attributes,
    default_model_parallel_groups,
)
from megatron.core.optimizer.shard_gather import ParamPieces, ShardSnapshot

GATHERED_FORMAT = "megatron-distributed-optimizer/gathered-v1"
SHARDED_FORMAT = "megatron-distributed-optimizer/sharded-v1"

# Group keys that describe how this run computes, not what it trained: never taken from a
# checkpoint (a state saved with fused CUDA kernels must load on a CPU run).
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")



def merge_param_groups(saved: Optional[Sequence[dict]], current: Sequence[dict]) -> list[dict]:
    """torch param groups holding ``current``'s parameters (and implementation switches) with
    the ``saved`` hyper-parameters (``current``'s own when None)."""
    if saved is None:
        return [dict(c) for c in current]
    return [{**s, **{k: c[k] for k in _IMPLEMENTATION_KEYS if k in c}, "params": c["params"]}
            for s, c in zip(saved, current)]


# Optimizer state tensors that have the shape of the parameter (and are sharded like it).
_SHARDED_STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "accum_grad")


@dataclass(eq=False)
class _Shard:
    """The piece ``[param_lo, param_hi)`` of a flattened model parameter this rank owns,
    stored at ``[lo, hi)`` of ``buffer``, with its fp32 main copy."""

    model_param: nn.Parameter
    buffer: ParamAndGradBuffer
    chunk: int
    name: str
    lo: int
    hi: int
    param_lo: int
    param_hi: int
    main: nn.Parameter


def _buffer_rank(buffer: ParamAndGradBuffer) -> int:
    """This rank's place in the group ``buffer`` is sharded over (the data-parallel group;
    for experts under expert parallelism, the expert-data-parallel group)."""
    return dist.get_rank(buffer.dp_group) if buffer.dp_size > 1 else 0


def _owned_shards(chunk_index: int, chunk: nn.Module) -> list[_Shard]:
    names = {p: n for n, p in unwrap_model(chunk).named_parameters()}
    shards = []
    for buffer in chunk.buffers:
        for bucket in buffer.buckets:
            lo, hi = bucket.shard_range(_buffer_rank(buffer), buffer.dp_size)
            for p in bucket.params:
                start, end = buffer.param_index[p]
                a, b = max(start, lo), min(end, hi)
                if a >= b:
                    continue
                main = nn.Parameter(buffer.param_data[a:b].detach().float())  # a copy
                copy_param_attributes(p, main)
                shards.append(_Shard(p, buffer, chunk_index, names[p], a, b, a - start,
                                     b - start, main))
    return shards


def _pieces(buffer: ParamAndGradBuffer, start: int, end: int,
            dp_size: int) -> tuple[tuple[int, int, int], ...]:
    """(dp rank, lo, hi) of the parameter at ``[start, end)`` of ``buffer``, in parameter
    coordinates: the overlap of each rank's shard of each bucket with the parameter."""
    pieces = []
    for bucket in buffer.buckets:
        for rank in range(dp_size):
            lo, hi = bucket.shard_range(rank, dp_size)
            a, b = max(start, lo), min(end, hi)
            if a < b:
                pieces.append((rank, a - start, b - start))
    return tuple(sorted(pieces, key=lambda piece: piece[1]))


class DistributedOptimizer(MegatronOptimizer):
    """Main weights and optimizer state sharded over data parallel (see module docstring)."""

    shards_state = True

    def __init__(self, config: OptimizerConfig, model_chunks: Sequence[nn.Module],
                 param_groups: Sequence[dict], make_optimizer: OptimizerFactory,
                 grad_scaler: Optional[MegatronGradScaler]) -> None:
        for chunk in model_chunks:
            buffers = getattr(chunk, "buffers", None)
            if not isinstance(buffers, list) or not all(b.shard_over_dp for b in buffers):
                raise ConfigError(
                    "--use-distributed-optimizer needs every model chunk wrapped in "
                    "DistributedDataParallel(..., use_distributed_optimizer=True)")
        if config.fp16 and grad_scaler is None:
            raise ValueError("fp16 training needs a grad scaler (--loss-scale or dynamic)")
        self.model_chunks = list(model_chunks)
        self.dp_group = self.model_chunks[0].data_parallel_group
        self.dp_size = self.model_chunks[0].data_parallel_size
        self.dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        self.buffers = [b for c in self.model_chunks for b in c.buffers]
        self.shards = [s for i, c in enumerate(self.model_chunks)
                       for s in _owned_shards(i, c)]
        shard_of = {s.model_param: s for s in self.shards}
        main_groups = [[shard_of[p].main for p in g["params"] if p in shard_of]
                       for g in param_groups]
        super().__init__(config, make_optimizer(_with_params(param_groups, main_groups)),
                         grad_scaler)
        self._shard_of_main = {s.main: s for s in self.shards}

    def norm_groups(self) -> Groups:
        # Shards are disjoint across data-parallel ranks, so sums run over them as well.
        return [default_model_parallel_groups(), self.dp_group]

    def expert_groups(self) -> Groups:
        # Expert shards are disjoint across the expert-data ranks and the expert group's ranks
        # hold other experts: the data-parallel group (their product) counts each once.
        return []

    def _copy_model_grads_to_main_grads(self) -> None:
        for s in self.shards:
            s.main.grad = s.buffer.grad_data[s.lo:s.hi].float()

    def _copy_main_params_to_model_params(self) -> None:
        for s in self.shards:
            s.buffer.param_data[s.lo:s.hi].copy_(s.main.data)
            s.main.grad = None
        for buffer in self.buffers:
            buffer.all_gather_params()

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for s in self.shards:
                s.main.data.copy_(s.buffer.param_data[s.lo:s.hi])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for s in self.shards:
            s.model_param.grad = None

    # Checkpoints: gathered (any dp size) -----------------------------------------------------

    def _ordered_mains(self) -> list[nn.Parameter]:
        """Main shards in the torch optimizer's state-dict index order."""
        return self.get_main_params()

    def _dp_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over the data-parallel ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.buffers[0].grad_data.device)
        all_reduce_over(t, self.dp_group, dist.ReduceOp.MAX)
        return t.tolist()

    def _present_state_keys(self) -> list[str]:
        """State keys any rank holds (a rank may own no shard, or state may not exist yet)."""
        local = [0.0] * len(_SHARDED_STATE_KEYS)
        for main in self._ordered_mains():
            state = self.optimizer.state.get(main, {})
            for i, key in enumerate(_SHARDED_STATE_KEYS):
                if isinstance(state.get(key), torch.Tensor):
                    local[i] = 1.0
        present = self._dp_max(local)
        return [k for k, flag in zip(_SHARDED_STATE_KEYS, present) if flag > 0]

    def _global_step(self) -> Optional[float]:
        steps = [float(self.optimizer.state[m]["step"]) for m in self._ordered_mains()
                 if "step" in self.optimizer.state.get(m, {})]
        step = self._dp_max([max(steps, default=-1.0)])[0]
        return None if step < 0 else step

    def _gather_full(self, buffer: ParamAndGradBuffer, key: str) -> torch.Tensor:
        """A flat fp32 tensor of ``buffer``'s size holding ``key`` (``param``: main weights)."""
        full = torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.grad_data.device)
        for s in self.shards:
            if s.buffer is not buffer:
                continue
            value = s.main.data if key == "param" else self.optimizer.state[s.main].get(key)
            if value is not None:  # a shard without state (yet) contributes zeros
                full[s.lo:s.hi].copy_(value)
        if buffer.dp_size > 1:
            for bucket in buffer.buckets:
                lo, hi = bucket.shard_range(_buffer_rank(buffer), buffer.dp_size)
                all_gather_flat(full[bucket.start:bucket.end], full[lo:hi].clone(),
                                buffer.dp_group)
        return full

    def gathered_state_dict(self) -> dict:
        """The data-parallel-independent state (collective over the data-parallel group)."""
        keys = ["param"] + self._present_state_keys()
        step = self._global_step()
        param_state: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in self.model_chunks]
        for chunk_index, chunk in enumerate(self.model_chunks):
            names = {p: n for n, p in unwrap_model(chunk).named_parameters()}
            for buffer in chunk.buffers:
                fulls = {key: self._gather_full(buffer, key).cpu() for key in keys}
                for p, (start, end) in buffer.param_index.items():
                    param_state[chunk_index][names[p]] = {
                        key: full[start:end].view(p.shape).clone() for key, full in fulls.items()
                    }
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.state_dict()["param_groups"]]
        return {
            "format": GATHERED_FORMAT,
            "param_groups": groups,
            "step": step,
            "param_state": param_state,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

    def shard_snapshot(self, copy: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                       ) -> ShardSnapshot:
        """This rank's share of the state and where every rank's pieces go, for
        ``shard_gather.gather_to_first`` (collective over the data-parallel group: which
        state keys exist, the step). ``copy``: makes each piece's host copy (training may go
        on while they are written); without it the pieces are the live tensors."""
        keys = ["param"] + self._present_state_keys()
        step = self._global_step()
        params, own = [], {}
        for chunk_index, chunk in enumerate(self.model_chunks):
            names = {p: n for n, p in unwrap_model(chunk).named_parameters()}
            for buffer in chunk.buffers:
                for p, (start, end) in buffer.param_index.items():
                    params.append(ParamPieces(chunk_index, names[p], tuple(p.shape),
                                              _pieces(buffer, start, end, self.dp_size)))
        for s in self.shards:
            state = self.optimizer.state.get(s.main, {})
            piece = {}
            for key in keys:
                value = s.main.data if key == "param" else state.get(key)
                if value is None:  # no state yet: zeros, as gathered_state_dict saves
                    value = torch.zeros_like(s.main.data)
                piece[key] = copy(value) if copy is not None else value.detach()
            own[(s.chunk, s.name)] = piece
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.state_dict()["param_groups"]]
        return ShardSnapshot(keys, step, groups,
                             self.grad_scaler.state_dict() if self.grad_scaler else None,
                             len(self.model_chunks), params, own, self.dp_rank, self.dp_size)

    def state_dict(self) -> dict:
        """Same as ``gathered_state_dict()``: a collective over the data-parallel group."""
        return self.gathered_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a gathered (any dp size) or sharded (same dp size) state; collective."""
        fmt = state_dict.get("format")
        if fmt == SHARDED_FORMAT:
            self.load_sharded_state_dict(state_dict)
        elif fmt == GATHERED_FORMAT:
            self._load_gathered(state_dict)
        else:
            raise ValueError(f"not a distributed-optimizer state dict (format {fmt!r}, keys "
                             f"{sorted(state_dict)}); was it saved without "
                             "--use-distributed-optimizer?")

    def _saved_entry(self, state_dict: dict, shard: _Shard) -> dict:
        chunks = state_dict["param_state"]
        if shard.chunk >= len(chunks) or shard.name not in chunks[shard.chunk]:
            raise KeyError(f"optimizer checkpoint has no state for parameter {shard.name!r} "
                           f"of model chunk {shard.chunk}")
        entry = chunks[shard.chunk][shard.name]
        if entry["param"].numel() != shard.model_param.numel():
            raise ValueError(f"optimizer checkpoint has shape {tuple(entry['param'].shape)} for "
                             f"{shard.name!r}, the model has {tuple(shard.model_param.shape)}")
        return entry

    def _load_gathered(self, state_dict: dict) -> None:
        pieces = []
        for main in self._ordered_mains():
            shard = self._shard_of_main[main]
            entry = self._saved_entry(state_dict, shard)
            pieces.append({k: v.reshape(-1)[shard.param_lo:shard.param_hi]
                           for k, v in entry.items()})
        self.load_shard_state(pieces, state_dict["param_groups"], state_dict.get("step"),
                              state_dict.get("grad_scaler"))

    def main_shards(self) -> list[tuple[int, str, int, int]]:
        """``(chunk index, parameter name, param_lo, param_hi)`` of each main shard of this
        rank, in the torch optimizer's index order: the flat elements ``[param_lo,
        param_hi)`` of that model parameter are this rank's."""
        return self._layout()

    def load_shard_state(self, pieces: Sequence[dict], param_groups: Optional[Sequence[dict]],
                         step: Optional[float], grad_scaler: Optional[dict]) -> None:
        """Load this rank's shards: ``pieces[i]`` holds main shard ``i``'s (``main_shards()``
        order) fp32 main weights under ``param`` and its optimizer state tensors (flat, of the
        shard's length; none before the first step). ``param_groups``: the saved groups'
        hyper-parameters (None: keep this run's). Collective over data parallel (the model
        parameters are re-gathered from the shards)."""
        current = self.optimizer.state_dict()["param_groups"]
        if param_groups is not None and len(param_groups) != len(current):
            raise ValueError(f"optimizer checkpoint has {len(param_groups)} param groups, "
                             f"this model has {len(current)}")
        state = {}
        for index, (main, piece) in enumerate(zip(self._ordered_mains(), pieces)):
            piece = {k: v.clone() for k, v in piece.items()}
            with torch.no_grad():
                main.data.copy_(piece.pop("param"))
            if piece:
                if step is not None:
                    piece["step"] = torch.tensor(float(step))
                state[index] = piece
        self.optimizer.load_state_dict({"state": state,
                                        "param_groups": merge_param_groups(param_groups, current)})
        if self.grad_scaler is not None and grad_scaler:
            self.grad_scaler.load_state_dict(grad_scaler)
        with torch.no_grad():
            self._copy_main_params_to_model_params()

    def global_step(self) -> Optional[float]:
        """The optimizer's step count (the largest over data-parallel ranks: a rank may own no
        shard); a collective over data parallel."""
        return self._global_step()

    def _load_scaler(self, state_dict: dict) -> None:
        if self.grad_scaler is not None and state_dict.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    # Checkpoints: sharded (same dp size) -----------------------------------------------------

    def _layout(self) -> list[tuple[int, str, int, int]]:
        return [(s.chunk, s.name, s.param_lo, s.param_hi) for s in self._ordered_mains_shards()]

    def _ordered_mains_shards(self) -> list[_Shard]:
        return [self._shard_of_main[m] for m in self._ordered_mains()]

    def sharded_state_dict(self) -> dict:
        """This rank's shard of the state; no communication. Loads only at the same layout."""
        return {
            "format": SHARDED_FORMAT,
            "data_parallel_size": self.dp_size,
            "data_parallel_rank": self.dp_rank,
            "layout": self._layout(),
            "optimizer": self.optimizer.state_dict(),
            "main_params": [m.detach().clone() for m in self._ordered_mains()],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Load what ``sharded_state_dict()`` returned on this dp rank; collective."""
        saved = (state_dict["data_parallel_size"], state_dict["data_parallel_rank"])
        if saved != (self.dp_size, self.dp_rank):
            raise ValueError(
                f"sharded optimizer state was saved by data-parallel rank {saved[1]} of "
                f"{saved[0]}, this is rank {self.dp_rank} of {self.dp_size}; save with "
                "state_dict() (gathered) to change the data-parallel size")
        if [tuple(x) for x in state_dict["layout"]] != self._layout():
            raise ValueError("sharded optimizer state has a different parameter layout "
                             "(model or bucket size changed); save with state_dict() instead")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for main, value in zip(self._ordered_mains(), state_dict["main_params"]):
                main.data.copy_(value)
            self._copy_main_params_to_model_params()
        self._load_scaler(state_dict)


"""The optimizer state of a torch_dist checkpoint: per parameter, in model space.

As megatron-core names it, the state of the parameter stored as ``<key>`` is
``optimizer.state.<kind>.<key>``, a tensor of the parameter's global shape: ``exp_avg`` and
``exp_avg_sq`` (Adam), ``momentum_buffer`` (SGD), and the fp32 main weights, ``param`` (the
distributed optimizer; Megatron-LM's ``fully_reshardable``) or ``fp32_param`` (the
mixed-precision optimizer without it). The step count, the param groups' hyper-parameters
and the loss scale are in ``common.pt["optimizer"]`` (Megatron-LM keeps its step in its
optimizer's ``common_step`` or param groups). Megatron-LM's default distributed-optimizer
format stores the state as its flat buckets instead (``dp_reshardable``), which
``mcore_buckets`` lays out again and reads into the same slots; its step is in a byte object
of the checkpoint (``with_bucket_step``).

The torch optimizer's main parameters are *slots*: a whole model parameter (``FP32Optimizer``,
``MixedPrecisionOptimizer``), or the flat range ``[lo, hi)`` of one that this data-parallel rank
owns (``DistributedOptimizer``), which is stored as the few boxes it covers.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.torch_dist import dcp, mcore_buckets
from megatron.checkpointing.formats.torch_dist.mcore_layout import (
    OPTIMIZER_PREFIX,
    Place,
    first_replica,
    optimizer_key,
)
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.distrib_optimizer import merge_param_groups
from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer, shards_state

MAIN_KINDS = ("param", "fp32_param")  # where fp32 main weights are stored

# (chunk index, our parameter name) -> (the parameter, where it is stored)
Places = dict[tuple[int, str], tuple[nn.Parameter, Place]]


class Slot(NamedTuple):
    """One main parameter of the torch optimizer (in its index order): the model parameter
    ``name`` of chunk ``chunk``, all of it (``lo is None``) or its flat range ``[lo, hi)``;
    ``has_main``: a separate fp32 main copy exists (else the model parameter is stepped)."""

    chunk: int
    name: str
    lo: Optional[int]
    hi: Optional[int]
    has_main: bool


def optimizer_slots(optimizer: Any, chunks: list[nn.Module]) -> list[Slot]:
    if shards_state(optimizer):
        return [Slot(c, n, lo, hi, True) for c, n, lo, hi in optimizer.main_shards()]
    where = {p: (i, n) for i, c in enumerate(chunks)
             for n, p in unwrap_model(c).named_parameters()}
    if isinstance(optimizer, MixedPrecisionOptimizer):
        pairs = zip(chain(*optimizer.model_groups), chain(*optimizer.main_groups))
        return [Slot(*where[model], None, None, main is not model) for model, main in pairs]
    if isinstance(optimizer, FP32Optimizer):
        return [Slot(*where[p], None, None, False) for p in optimizer.get_main_params()]
    raise CheckpointError(f"--ckpt-format torch_dist cannot save or load the optimizer state "
                          f"of {type(optimizer).__name__}")


def boxes(place: Place, shape: tuple, flat: torch.Tensor, lo: Optional[int],
          hi: Optional[int]) -> list[tuple[tuple, torch.Tensor]]:
    """``(global offset, tensor)`` of each box of ``flat``: a parameter's whole tensor (any
    shape with its elements), or the flat range ``[lo, hi)`` of it."""
    flat = flat.reshape(-1)  # a view: what is read into it lands in the tensor given
    if lo is None:
        lo, hi = 0, math.prod(shape)
        runs = [((0,) * len(shape), tuple(shape), 0)]
    else:
        runs = dcp.flat_boxes(shape, lo, hi)
    out = []
    for local_offset, local_sizes, first in runs:
        # A box crossing where two parts meet (SwiGLU) is cut in two: rows stay contiguous.
        row = math.prod(local_sizes[1:]) if local_sizes else 1
        for offset, sizes, part_offset, part_sizes in place.boxes(local_offset, local_sizes):
            start = first - lo + (part_offset[0] - local_offset[0]) * row if part_offset else \
                first - lo
            n = math.prod(part_sizes)
            out.append((offset, flat[start:start + n].reshape(sizes)))
    return out


# Writing -------------------------------------------------------------------------------------


def optimizer_common(optimizer: Any) -> dict:
    """Step, hyper-parameters and loss scale (a collective for the distributed optimizer)."""
    if shards_state(optimizer):
        step = optimizer.global_step()
    else:
        steps = [float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s]
        step = max(steps) if steps else None
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in optimizer.optimizer.state_dict()["param_groups"]]
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None
    return {"param_groups": groups, "step": step, "grad_scaler": scaler}


def optimizer_pieces(optimizer: Any, chunks: list[nn.Module], places: Places,
                     dp_rank: int, expert_parallel_size: int = 1) -> list[dcp.Piece]:
    """What this rank writes of the optimizer state: its shards (distributed optimizer), or
    the whole state of the parameters it writes (``mcore_layout.first_replica``: on
    data-parallel rank 0, experts on their expert groups' first); replicas over tensor
    parallelism are written by tensor rank 0."""
    distributed = shards_state(optimizer)
    main_kind = "param" if distributed else "fp32_param"
    pieces = []
    for slot, main in zip(optimizer_slots(optimizer, chunks), optimizer.get_main_params()):
        param, place = places[(slot.chunk, slot.name)]
        if not place.writer or not (distributed or first_replica(param, dp_rank,
                                                                   expert_parallel_size)):
            continue
        state = {k: v for k, v in optimizer.optimizer.state.get(main, {}).items()
                 if isinstance(v, torch.Tensor) and k != "step"}
        if slot.has_main:
            state = {main_kind: main, **state}
        for kind, value in state.items():
            key = optimizer_key(kind, place.key)
            for offset, box in boxes(place, tuple(param.shape), value.detach(), slot.lo,
                                     slot.hi):
                pieces.append(dcp.Piece(key, place.global_shape, offset, box))
    return pieces


# Reading -------------------------------------------------------------------------------------


def optimizer_kinds(metadata: Any, key: str) -> list[str]:
    """The optimizer state kinds the checkpoint stores for the parameter ``key``."""
    prefix, suffix = OPTIMIZER_PREFIX, f".{key}"
    return [k[len(prefix):-len(suffix)] for k in metadata.state_dict_metadata
            if k.startswith(prefix) and k.endswith(suffix)
            and "." not in k[len(prefix):-len(suffix)]]


def no_optimizer_state(common: dict, where: str) -> CheckpointError:
    """The error of a load that wants optimizer state the checkpoint does not hold."""
    return CheckpointError(f"checkpoint {where}: it holds no optimizer state (saved with "
                           "--no-save-optim?). Pass --no-load-optim to continue with a fresh "
                           "optimizer (and the LR schedule from your flags), or --finetune to "
                           "start at iteration 0")


class OptimizerRead(NamedTuple):
    slots: list[Slot]
    values: list[dict]  # per slot: kind -> flat fp32 tensor being read
    # (slot view, read view) pairs to copy once the pieces are read (megatron-core's buckets)
    copies: tuple = ()


def _before_first_step(common: dict) -> bool:
    """Ours, saved before the optimizer's first step: no state tensors to read."""
    opt = common.get("optimizer")
    return isinstance(common.get("config"), dict) and isinstance(opt, dict) \
        and opt.get("step") is None


def optimizer_requests(optimizer: Any, chunks: list[nn.Module], places: Places, metadata: Any,
                       common: dict, where: str,
                       model_config: Any) -> tuple[OptimizerRead, list[dcp.Piece]]:
    """What this rank reads of the optimizer state, into new fp32 tensors: per parameter in
    model space, or from Megatron-LM's dp_reshardable buckets (``mcore_buckets``, laid out
    for ``model_config``). Raises ``no_optimizer_state`` when the checkpoint holds neither."""
    slots = optimizer_slots(optimizer, chunks)
    layout = mcore_buckets.bucket_layout(metadata, common, model_config, where)
    reads = mcore_buckets.BucketReads(layout, metadata, where) if layout else None
    values, pieces, missing = [], [], []
    for slot in slots:
        param, place = places[(slot.chunk, slot.name)]
        kinds = layout.kinds if layout else optimizer_kinds(metadata, place.key)
        wanted = [k for k in kinds if k not in MAIN_KINDS]
        if not wanted:
            missing.append(place.key)
        mains = [k for k in MAIN_KINDS if k in kinds]
        if slot.has_main and mains:
            wanted.append(mains[0])
        n = param.numel() if slot.lo is None else slot.hi - slot.lo
        entry = {kind: torch.zeros(n, dtype=torch.float32) for kind in wanted}
        for kind, flat in entry.items():
            for offset, box in boxes(place, tuple(param.shape), flat, slot.lo, slot.hi):
                if reads:
                    reads.request(kind, place, offset, box)
                else:
                    pieces.append(dcp.Piece(optimizer_key(kind, place.key),
                                            place.global_shape, offset, box))
        values.append(entry)
    if missing and not (len(missing) == len(slots) and _before_first_step(common)):
        if len(missing) == len(slots):
            raise no_optimizer_state(common, where)
        raise CheckpointError(f"checkpoint {where} holds optimizer state for some parameters "
                              f"but not for {', '.join(sorted(set(missing))[:5])}")
    copies = []
    if reads:
        bucket_pieces, copies = reads.pieces()
        pieces += bucket_pieces
    return OptimizerRead(slots, values, tuple(copies)), pieces


def with_bucket_step(common: dict, step_object: Any) -> dict:
    """``common`` whose optimizer entry also holds megatron-core's optimizer object of a
    dp_reshardable checkpoint (its param groups carry the step; its loss scale, if any)."""
    if not isinstance(step_object, list) or len(step_object) != 1 \
            or not isinstance(step_object[0], dict):
        return common
    opt = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    return {**common, "optimizer": {**opt, **step_object[0]}}


def saved_step(common: dict) -> Optional[float]:
    """The optimizer step: ours at ``optimizer.step``; megatron-core keeps it as its
    optimizer's ``common_step`` or in its torch param groups (nested in its wrappers)."""
    opt = common.get("optimizer")
    if isinstance(opt, dict) and "step" in opt and not isinstance(opt["step"], dict):
        return None if opt["step"] is None else float(opt["step"])
    steps = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            common_step = value.get("common_step")
            if isinstance(common_step, (int, float, torch.Tensor)):
                steps.append(float(common_step))
            if isinstance(value.get("param_groups"), list):
                steps.extend(float(g["step"]) for g in value["param_groups"]
                             if isinstance(g, dict) and isinstance(g.get("step"), (int, float)))
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
    walk(opt)
    return max(steps) if steps else None


def _saved_groups_and_scaler(common: dict) -> tuple[Optional[list], Optional[dict]]:
    """Ours: the saved hyper-parameters and loss scale. Megatron-LM's groups are built by
    other rules (this run's are kept; the schedule sets lr and weight decay); its loss scale
    is taken when it has one."""
    opt = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    if isinstance(common.get("config"), dict):
        return opt.get("param_groups"), opt.get("grad_scaler")
    scaler = opt.get("grad_scaler")
    return None, scaler if isinstance(scaler, dict) and "scale" in scaler else None


def apply_optimizer(optimizer: Any, read: OptimizerRead, common: dict) -> None:
    """Put what was read into ``optimizer``, whose main weights already follow the loaded
    model (``reload_model_params``): stored fp32 main weights replace them."""
    for target, value in read.copies:
        target.copy_(value)
    groups, scaler = _saved_groups_and_scaler(common)
    step = saved_step(common)
    mains = optimizer.get_main_params()
    entries = []
    for slot, entry, main in zip(read.slots, read.values, mains):
        entry = dict(entry)
        stored = [entry.pop(k) for k in MAIN_KINDS if k in entry]
        if slot.has_main:
            entry["param"] = stored[0] if stored else main.detach().float().reshape(-1)
        entries.append(entry)
    if shards_state(optimizer):
        optimizer.load_shard_state(entries, groups, step, scaler)
        return
    current = optimizer.optimizer.state_dict()["param_groups"]
    if groups is not None and len(groups) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} param groups, "
                              f"this one {len(current)}")
    state = {}
    for index, (main, entry) in enumerate(zip(mains, entries)):
        values = {k: v.view(main.shape) for k, v in entry.items() if k != "param"}
        if values and step is not None:
            values["step"] = torch.tensor(step)
        if values:
            state[index] = values
    torch_state = {"state": state, "param_groups": merge_param_groups(groups, current)}
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        optimizer.load_state_dict(torch_state)
        return
    fp32_mains, index = [], 0
    for models, group_mains in zip(optimizer.model_groups, optimizer.main_groups):
        fp32_mains.append([])
        for model, main in zip(models, group_mains):
            if main is not model:
                fp32_mains[-1].append(entries[index]["param"].view(main.shape))
            index += 1
    optimizer.load_state_dict({"optimizer": torch_state, "grad_scaler": scaler,
                               "fp32_from_fp16_params": fp32_mains})

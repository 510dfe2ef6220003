"""Checkpoints of expert-parallel runs hold every expert, as one run holding all experts on
each rank would write them: the files do not depend on ``--expert-model-parallel-size``, so
a checkpoint loads at any expert-parallel size, and the converter, the inference tools and
Hugging Face export read it as they read any other.

Saving (``gathered_for_save``, a collective over the expert group): each rank's experts are
renamed from their local number (``local_experts.j``) to their global one and gathered, with
their optimizer state (the plain optimizers' torch state dicts, numbered by position, are
rebuilt for the whole model's parameter order). Loading (``localized``, no communication):
each rank keeps its own experts, renamed back, and its own part of that optimizer state.
The distributed optimizer's state is gathered whole on each rank
(``gathered_optimizer_for_save``: its ``gathered_state_dict``, keyed by name, experts
renamed and exchanged likewise) rather than streamed piece by piece to data-parallel rank 0
as without experts: each rank holds its parameters' whole state for the moment of the save.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from megatron.checkpointing.contents import model_keys
from megatron.checkpointing.formats.torch.cut import torch_optimizer
from megatron.checkpointing.formats.torch.whole import named_torch_state
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.model.moe import moe_layers

_EXPERT = re.compile(r"(.*\.mlp\.local_experts\.)(\d+)(\..+)")


def _shift(name: str, offset: int) -> str:
    m = _EXPERT.fullmatch(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m else name


def _placement(chunks: list[nn.Module]) -> Optional[tuple[int, int, int]]:
    """(first global expert of this rank, experts per rank, experts in all) under expert
    parallelism, else None."""
    layers = [layer for chunk in chunks for layer in moe_layers(unwrap_model(chunk))]
    if not layers or layers[0].ep_size == 1:
        return None
    layer = layers[0]
    return layer.first_expert, layer.num_local, layer.num_local * layer.ep_size


def _whole_order(local: dict, num_experts: int) -> list[str]:
    """The whole model's names, in its order, from a rank's state dict (``local``'s expert
    names already global): each layer's block of experts becomes all ``num_experts``."""
    names, blocks = [], set()
    for name in local:
        m = _EXPERT.fullmatch(name)
        if m is None:
            names.append(name)
            continue
        if m.group(1) in blocks:
            continue
        blocks.add(m.group(1))
        first = int(m.group(2))
        suffixes = [s[3] for s in (_EXPERT.fullmatch(n) for n in local)
                    if s is not None and s.group(1) == m.group(1) and int(s.group(2)) == first]
        names += [f"{m.group(1)}{e}{suffix}" for e in range(num_experts) for suffix in suffixes]
    return names


def gathered_for_save(chunks: list[nn.Module], optimizer: Any, with_optimizer: bool) -> Optional[tuple[list[dict], Optional[dict]]]:
    """``(model state dicts, plain optimizer state)`` of the whole model, every expert
    present, on every rank of the expert group (a collective there); None without expert
    parallelism (the rank's own state is the whole model's)."""
    placement = _placement(chunks)
    if placement is None:
        return None
    first, _, num_experts = placement
    group = parallel_state.get_expert_model_parallel_group()
    local = [{_shift(k, first): v for k, v in unwrap_model(c).state_dict().items()}
             for c in chunks]
    experts = [_experts_of(sd) for sd in local]
    opt_experts, meta, saved = None, None, None
    if with_optimizer and optimizer is not None:
        saved = optimizer.state_dict()
        per_chunk, meta = named_torch_state(saved, local, "optimizer state")
        opt_experts = [_experts_of(sd) for sd in per_chunk]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (experts, opt_experts), group=group)
    models = []
    for i, sd in enumerate(local):
        merged = {**sd, **{k: v for theirs, _ in everyone for k, v in theirs[i].items()}}
        models.append({k: merged[k] for k in _whole_order(sd, num_experts)})
    if meta is None:
        return models, None
    states = [{**per_chunk[i], **{k: v for _, theirs in everyone for k, v in theirs[i].items()}}
              for i in range(len(chunks))]
    return models, torch_optimizer(meta, models, states, "fp32_from_fp16_params" in saved)


def _experts_of(state: dict) -> dict:
    """The expert entries of a state dict, on the host (they travel to the other ranks)."""
    def host(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: host(v) for k, v in value.items()}
        return value.detach().cpu() if hasattr(value, "detach") else value
    return {k: host(v) for k, v in state.items() if _EXPERT.fullmatch(k)}


def gathered_optimizer_for_save(chunks: list[nn.Module], optimizer: Any) -> Optional[dict]:
    """The distributed optimizer's gathered state of the whole model (every expert under its
    global number), on every rank; a collective over the data-parallel groups and the expert
    group. None without expert parallelism."""
    placement = _placement(chunks)
    if placement is None:
        return None
    first = placement[0]
    state = optimizer.gathered_state_dict()
    local = [{_shift(k, first): v for k, v in sd.items()} for sd in state["param_state"]]
    everyone: list = [None] * dist.get_world_size(parallel_state.get_expert_model_parallel_group())
    dist.all_gather_object(everyone, [_experts_of(sd) for sd in local],
                           group=parallel_state.get_expert_model_parallel_group())
    merged = [{**sd, **{k: v for theirs in everyone for k, v in theirs[i].items()}}
              for i, sd in enumerate(local)]
    return {**state, "param_state": merged}


def localized_optimizer(gathered: Optional[dict], chunks: list[nn.Module]) -> Optional[dict]:
    """The distributed optimizer's gathered state (every expert) with this rank's experts
    only, under their local names."""
    placement = _placement(chunks)
    if placement is None or gathered is None or "param_state" not in gathered:
        return gathered
    first, per_rank, _ = placement
    return {**gathered, "param_state": [{_shift(k, -first): v for k, v in sd.items()
                                         if _is_mine(k, first, per_rank)}
                                        for sd in gathered["param_state"]]}


def _is_mine(name: str, first: int, per_rank: int) -> bool:
    m = _EXPERT.fullmatch(name)
    return m is None or first <= int(m.group(2)) < first + per_rank


def localized(state: dict, chunks: list[nn.Module]) -> dict:
    """``state`` (a model_optim_rng.pt dict holding every expert) with only this rank's
    experts, under their local names, in its models and plain optimizer state."""
    placement = _placement(chunks)
    if placement is None:
        return state
    first, per_rank, _ = placement
    keys = [k for k in model_keys(len(chunks)) if k in state]
    whole = [state[k] for k in keys]

    def mine(name: str) -> bool:
        return _is_mine(name, first, per_rank)

    local = [{_shift(k, -first): v for k, v in sd.items() if mine(k)} for sd in whole]
    out = {**state, **dict(zip(keys, local))}
    saved = state.get("optimizer")
    if saved is not None and len(keys) == len(chunks):
        per_chunk, meta = named_torch_state(saved, whole, "optimizer state")
        states = [{_shift(k, -first): v for k, v in sd.items() if mine(k)} for sd in per_chunk]
        out["optimizer"] = torch_optimizer(meta, local, states,
                                           "fp32_from_fp16_params" in saved)
    return out

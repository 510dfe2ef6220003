"""Optimizer state in one layout-free form, read from and written to each rank's format.

The full form (what ``FullCheckpoint.optimizer`` holds)::

    {"param_groups": [hyper-parameters of each group, without "params", in group order],
     "step": the optimizer's step count (None before the first step),
     "param_state": {full name: {"exp_avg": ..., "exp_avg_sq": ..., ["param": fp32 main]}},
     "grad_scaler": the loss scaler's state or None}

each tensor the shape of its full parameter. It is the distributed optimizer's gathered format
(``megatron/core/optimizer/distrib_optimizer.py``) for one model chunk under full names.

A rank's optimizer takes one of three forms: the distributed optimizer's ``distrib_optim.pt``
(keyed by chunk and parameter name), ``FP32Optimizer``'s torch state dict, or
``MixedPrecisionOptimizer``'s ``{"optimizer", "grad_scaler", "fp32_from_fp16_params"}``. The
torch state dicts number parameters by position: groups as ``get_param_groups`` builds them
(weight-decayed first, then biases and 1-D parameters), each in model-chunk and parameter order.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.optimizer.distrib_optimizer import GATHERED_FORMAT

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def decays(name: str, shape: torch.Size) -> bool:
    """``default_no_weight_decay``'s rule: biases and 1-D parameters get no weight decay."""
    return not (name.endswith(".bias") or len(shape) == 1)


def group_param_names(names_and_shapes: list[tuple[str, torch.Size]]) -> list[list[str]]:
    """Parameter names per optimizer group, in ``get_param_groups``'s order."""
    decayed = [n for n, s in names_and_shapes if decays(n, s)]
    plain = [n for n, s in names_and_shapes if not decays(n, s)]
    return [g for g in (decayed, plain) if g]


def _group_wd_mults(groups: list[list[str]], names_and_shapes) -> list[float]:
    shape = dict(names_and_shapes)
    return [1.0 if decays(g[0], shape[g[0]]) else 0.0 for g in groups]


def named_from_torch(torch_sd: dict, names_and_shapes: list[tuple[str, torch.Size]],
                     where: str) -> tuple[dict, list[dict], Optional[float]]:
    """``(param_state by name, param_groups without params, step)`` of a torch state dict."""
    groups = group_param_names(names_and_shapes)
    saved = torch_sd["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g) for g in groups]:
        raise ValueError(f"{where}: the optimizer's groups hold {[len(g['params']) for g in saved]} "
                         f"parameters, the model's {[len(g) for g in groups]} (a non-default "
                         "weight-decay rule?)")
    param_state, step = {}, None
    for group, names in zip(saved, groups):
        for index, name in zip(group["params"], names):
            entry = dict(torch_sd["state"].get(index, {}))
            if "step" in entry:
                step = float(entry.pop("step"))
            param_state[name] = {k: v for k, v in entry.items() if k in _STATE_KEYS}
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved]
    return param_state, hyper, step


def torch_from_named(param_state: dict, param_groups: list[dict], step: Optional[float],
                     names_and_shapes: list[tuple[str, torch.Size]]) -> dict:
    """A torch optimizer state dict over ``names_and_shapes`` (one rank's parameters)."""
    groups = group_param_names(names_and_shapes)
    by_wd = {g.get("wd_mult"): g for g in param_groups}
    state, out_groups, index = {}, [], 0
    for position, (names, wd) in enumerate(zip(groups, _group_wd_mults(groups, names_and_shapes))):
        hyper = by_wd.get(wd) or param_groups[min(position, len(param_groups) - 1)]
        ids = []
        for name in names:
            entry = {k: v for k, v in param_state.get(name, {}).items() if k in _STATE_KEYS}
            if entry:
                if step is not None:
                    entry["step"] = torch.tensor(float(step))
                state[index] = entry
            ids.append(index)
            index += 1
        out_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": out_groups}


def gathered_from_named(chunks_state: list[dict], full: dict) -> dict:
    """The distributed optimizer's gathered dict; ``chunks_state``: per chunk, its entries of
    ``full["param_state"]`` under the chunk's names (each with a ``param`` main copy)."""
    return {"format": GATHERED_FORMAT, "param_groups": full["param_groups"], "step": full["step"],
            "param_state": chunks_state, "grad_scaler": full.get("grad_scaler")}

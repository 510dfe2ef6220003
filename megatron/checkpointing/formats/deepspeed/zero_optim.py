"""ZeRO 1/2 optimizer state of a DeepSpeed checkpoint (plain model, or the pipeline engine at
tensor-parallel size 1), in the full form of
``optim_state`` (``{"param_groups", "step", "param_state": {name: {"exp_avg", "exp_avg_sq",
"param"}}, "grad_scaler"}``).

Each data-parallel rank ``d`` of tensor rank ``t`` wrote
``zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt``: per optimizer group, its contiguous slice
of the group's flat fp32 buffer (``single_partition_of_fp32_groups``), Adam's moments over the
same slice (``base_optimizer_state``) and ``param_slice_mappings`` (name -> start and length of
that parameter's piece in the slice). A parameter's pieces, taken in rank order, are its
flattened whole; ``param_shapes`` of the model-state file gives its shape.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from megatron.checkpointing.formats.deepspeed.files import read_zero_optimizer_file
from megatron.config import ModelConfig
from megatron.model.names import OUTPUT_LAYER, VOCAB_TENSORS, layer_key, tp_parts
from megatron.model.sharding import merge_tp, resize_vocab

_OPTIM_FILE_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d{2})_optim_states\.pt")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_PIPE_LAYER_RE = re.compile(r"(\d+)\.layers\.0\.(.+)")
_PIPE_FINAL_RE = re.compile(r"\d+\.(final_layernorm\..+)")


def read_zero_optimizer(step_dir: str, model_states: list[dict], config: ModelConfig,
                        stages: int = 1) -> Optional[dict]:
    """The full optimizer state, or None where the files are not ZeRO 1/2's fp32 partitions
    (ZeRO-3, DeepSpeed's bf16 optimizer, no optimizer files). ``model_states``: each
    model-parallel rank's ``mp_rank_XX_model_states.pt`` contents, in rank order; with the
    pipeline engine (``stages`` > 1, tensor-parallel size 1) one per stage, its parameters
    under ``PipelineModule``'s names."""
    files: dict[int, dict[int, str]] = {}
    for name in os.listdir(step_dir):
        m = _OPTIM_FILE_RE.fullmatch(name)
        if m:
            files.setdefault(int(m.group(2)), {})[int(m.group(1))] = os.path.join(step_dir, name)
    if sorted(files) != list(range(len(model_states))) or len(model_states) % stages:
        return None

    per_tp, meta = [], {}
    for t in range(len(model_states) // stages):
        named: dict = {}
        for mp in range(t, len(model_states), len(model_states) // stages):
            ranks = [read_zero_optimizer_file(files[mp][d])["optimizer_state_dict"]
                     for d in sorted(files[mp])]
            if not all("param_slice_mappings" in r and "single_partition_of_fp32_groups" in r
                       for r in ranks):
                return None
            stage_named, meta = _gather_tensor_rank(ranks, model_states[mp]["param_shapes"])
            for name, entry in stage_named.items():
                # The tied embedding is on the first and last stage, with the same state.
                named.setdefault(our_name(name) if stages > 1 else name, entry)
        per_tp.append(named)
    param_state = {name: {k: merge_tp(name, [rank[name][k] for rank in per_tp],
                                      tp_parts(name, config))
                          for k in entry} for name, entry in per_tp[0].items()}
    rows = config.padded_vocab_size
    for name in set(param_state) & set(VOCAB_TENSORS):
        param_state[name] = {k: resize_vocab(v, rows) for k, v in param_state[name].items()}
    return {**meta, "param_state": param_state, "grad_scaler": None}


_PIPE_UNTIED_RE = re.compile(r"\d+\.((?:word|position)_embeddings\.weight|lm_head\.weight)")


def our_name(pipe_name: str) -> str:
    """GPTModel's name of a ``PipelineModule`` parameter: ``tied_modules.embed.X`` (or, untied,
    ``0.X``) -> ``embedding.X``, ``{i}.layers.0.X`` (layer spec ``i``, 1-based) ->
    ``encoder.layers.{i-1}.X``, ``{i}.final_layernorm.X`` -> ``final_layernorm.X``, untied
    ``{i}.lm_head.weight`` -> ``output_layer.weight``."""
    if pipe_name.startswith("tied_modules.embed."):
        return "embedding." + pipe_name.removeprefix("tied_modules.embed.")
    m = _PIPE_UNTIED_RE.fullmatch(pipe_name)
    if m:
        return OUTPUT_LAYER if m.group(1) == "lm_head.weight" else "embedding." + m.group(1)
    m = _PIPE_LAYER_RE.fullmatch(pipe_name)
    if m:
        return layer_key(int(m.group(1)) - 1, m.group(2))
    m = _PIPE_FINAL_RE.fullmatch(pipe_name)
    if m:
        return m.group(1)
    raise ValueError(f"pipeline parameter {pipe_name}: not one of GPT's layers")


def _gather_tensor_rank(ranks: list[dict], param_shapes: list[dict]) -> tuple[dict, dict]:
    """One tensor rank's ``{name: {"param", "exp_avg", "exp_avg_sq"}}`` from its data-parallel
    ranks' partitions, and ``{"param_groups", "step"}``."""
    pieces: dict[str, dict[str, list]] = {}
    step = None
    for rank in ranks:
        base = rank["base_optimizer_state"]
        for g, mapping in enumerate(rank["param_slice_mappings"]):
            flat = {"param": rank["single_partition_of_fp32_groups"][g],
                    **{k: base["state"][g][k] for k in _MOMENTS}}
            if "step" in base["state"][g]:
                step = float(base["state"][g]["step"])
            for name, where in mapping.items():
                entry = pieces.setdefault(name, {k: [] for k in flat})
                for key, tensor in flat.items():
                    entry[key].append(tensor.narrow(0, where.start, where.numel))
    shapes = {name: shape for group in param_shapes for name, shape in group.items()}
    named = {name: {k: torch.cat(v).view(shapes[name]).clone() for k, v in entry.items()}
             for name, entry in pieces.items()}
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in ranks[0]["base_optimizer_state"]["param_groups"]]
    return named, {"param_groups": groups, "step": step}

"""Reading a torch-format folder whole: every ``mp_rank_*`` file of any tensor, pipeline and
virtual-pipeline size, with the distributed optimizer or without, merged into one tp 1 / pp 1
``FullCheckpoint`` (the last stage's copy of tied word embeddings dropped: it equals the first
stage's). Megatron-DeepSpeed's and Megatron-LM's legacy ``language_model`` files are read too
(model only)."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from megatron.checkpointing import optim_state
from megatron.checkpointing.contents import (
    CONVERTED_KEY,
    check_version,
    consumed_samples,
    extra_entries,
)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import read_torch
from megatron.checkpointing.folder import CheckpointFolder
from megatron.checkpointing.full_state import (
    FullCheckpoint,
    model_config_from_dict,
    repad_vocab,
    source_config,
)
from megatron.checkpointing.paths import DISTRIB_OPTIM_FILENAME
from megatron.config import ModelConfig
from megatron.model import megatron_deepspeed as mds
from megatron.model.names import TIED_COPY, VOCAB_TENSORS, is_buffer, tp_parts
from megatron.model.placement import Chunk
from megatron.model.sharding import (
    chunk_to_full_names,
    chunks_from_layer_counts,
    layer_count,
    merge_tp,
    resize_vocab,
)

logger = logging.getLogger(__name__)


def read_whole(folder: CheckpointFolder, *, verify: bool = True,
               true_vocab_size: Optional[int] = None, optimizer: bool = True) -> FullCheckpoint:
    """``conversion.read_folder`` of a torch-format folder."""
    iter_dir = folder.path
    if folder.manifest is not None and verify:
        wanted = [f for f in folder.manifest["files"]
                  if optimizer or os.path.basename(f) != DISTRIB_OPTIM_FILENAME]
        folder.verify(wanted, checksums=True)
    tp, pp = folder.layout()
    states = {}
    for t in range(tp):
        for p in range(pp):
            path = folder.rank_file(t, p, pp)
            states[(t, p)] = read_torch(path)
            check_version(states[(t, p)], path)
    first = states[(0, 0)]
    theirs = mds.is_megatron_deepspeed_model(first.get("model", first.get("model0", {})))
    config = source_config(first, theirs, true_vocab_size, iter_dir)
    chunk_states = {key: _chunk_states(state, theirs, folder.rank_file(*key, pp))
                    for key, state in states.items()}
    layout = chunks_from_layer_counts([[layer_count(c) for c in chunk_states[(0, p)]]
                                       for p in range(pp)])
    model_config = model_config_from_dict(config["model"])
    model = _merge_model(chunk_states, layout, tp, pp, model_config)
    optimizer_state, distributed = None, False
    if not theirs and not folder.release and optimizer:
        optimizer_state, distributed = _merge_optimizer(states, chunk_states, layout, tp, pp,
                                                        folder, model_config)
    elif theirs:
        logger.info("%s: Megatron-DeepSpeed checkpoint, converting the model only", iter_dir)
    train, valid = consumed_samples(first)
    return FullCheckpoint(
        config=config, model=model, optimizer=optimizer_state,
        iteration=0 if folder.release else int(first["iteration"]),
        consumed_train_samples=train, consumed_valid_samples=valid,
        scheduler=None if theirs else first.get("opt_param_scheduler"),
        extra={} if theirs else {k: v for k, v in extra_entries(first).items()
                                 if k != CONVERTED_KEY},
        release=folder.release, distributed_optimizer=distributed)


def _chunk_states(state: dict, theirs: bool, path: str) -> list[dict]:
    """The model chunks of one file under our chunk names (checked to number their layers
    from 0)."""
    keys = sorted((k for k in state if k == "model" or (k.startswith("model") and k[5:].isdigit())),
                  key=lambda k: int(k[5:] or 0))
    try:
        if not keys:
            raise ValueError("it holds no model ('model' entry)")
        chunks = [mds.MDS.to_ours(state[k], None) if theirs else state[k] for k in keys]
        for chunk in chunks:
            layer_count(chunk)
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from None
    return chunks


def _merge_model(chunk_states: dict, layout: list[list[Chunk]], tp: int, pp: int,
                 config: ModelConfig) -> dict:
    per_tp = [_rank_full_names(chunk_states, layout, t, pp) for t in range(tp)]
    model = {}
    for name in per_tp[0]:
        model[name] = merge_tp(name, [names[name] for names in per_tp], tp_parts(name, config))
    return repad_vocab(model, config.padded_vocab_size)


def _rank_full_names(per_rank: dict, layout: list[list[Chunk]], t: int, pp: int) -> dict:
    """Tensor rank ``t``'s entries of every stage and chunk, under full names (the last
    stage's tied copy dropped: it equals the first stage's word embeddings)."""
    out = {}
    for p in range(pp):
        for chunk, values in zip(layout[p], per_rank[(t, p)]):
            named = chunk_to_full_names(values, chunk)
            named.pop(TIED_COPY, None)
            out.update(named)
    return out


def _merge_optimizer(states: dict, chunk_states: dict, layout: list[list[Chunk]], tp: int,
                     pp: int, folder: CheckpointFolder,
                     config: ModelConfig) -> tuple[Optional[dict], bool]:
    """The full optimizer state of every rank's file, and whether it was distributed."""
    first = states[(0, 0)]
    distributed = bool(first.get("distributed_optimizer"))
    if not distributed and "optimizer" not in first:
        return None, False
    per_rank, meta = {}, {}
    for (t, p), state in states.items():
        if distributed:
            saved = read_torch(folder.rank_file(t, p, pp, DISTRIB_OPTIM_FILENAME))
            per_rank[(t, p)] = saved["param_state"]
            meta = {k: saved.get(k) for k in ("param_groups", "step", "grad_scaler")}
        else:
            per_rank[(t, p)], meta = named_torch_state(state["optimizer"], chunk_states[(t, p)],
                                                        folder.rank_file(t, p, pp))
    per_tp = [_rank_full_names(per_rank, layout, t, pp) for t in range(tp)]
    param_state = {}
    for name, entry in per_tp[0].items():
        param_state[name] = {key: merge_tp(name, [names[name][key] for names in per_tp],
                                           tp_parts(name, config))
                             for key in entry}
    rows = config.padded_vocab_size
    for name in set(param_state) & set(VOCAB_TENSORS):
        param_state[name] = {k: resize_vocab(v, rows) for k, v in param_state[name].items()}
    return {**meta, "param_state": param_state}, distributed


def named_torch_state(saved: dict, chunks: list[dict], where: str) -> tuple[list[dict], dict]:
    """Per chunk ``{chunk name: state}`` from a rank's torch (or mixed-precision) optimizer."""
    mixed = "fp32_from_fp16_params" in saved
    torch_sd = saved["optimizer"] if mixed else saved
    names = [(f"{i}/{name}", value.shape) for i, chunk in enumerate(chunks)
             for name, value in chunk.items() if not is_buffer(name)]
    state, groups, step = optim_state.named_from_torch(torch_sd, names, where)
    if mixed:
        _attach_mains(state, saved["fp32_from_fp16_params"], names, chunks)
    per_chunk: list[dict] = [{} for _ in chunks]
    for key, entry in state.items():
        index, name = key.split("/", 1)
        per_chunk[int(index)][name] = entry
    meta = {"param_groups": groups, "step": step,
            "grad_scaler": saved.get("grad_scaler") if mixed else None}
    return per_chunk, meta


def _attach_mains(state: dict, saved_mains: list, names: list, chunks: list[dict]) -> None:
    """The fp32 main copies of a mixed-precision optimizer, as each parameter's ``param``."""
    for group, mains in zip(optim_state.group_param_names(names), saved_mains):
        half = []
        for key in group:
            index, name = key.split("/", 1)
            if chunks[int(index)][name].dtype != torch.float32:
                half.append(key)
        for key, main in zip(half, mains):
            state[key]["param"] = main

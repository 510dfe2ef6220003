"""A whole checkpoint in one process: read every shard of a folder into one tp 1 / pp 1 state
(``load_full_checkpoint``), and write such a state at any tensor/pipeline layout
(``save_full_checkpoint``) in the layout ``megatron/checkpointing/`` saves and loads."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

import torch

from megatron.checkpointing.contents import (
    CONVERTED_KEY,
    check_version,
    consumed_samples,
    extra_entries,
    layout_dict,
    rank_file_state,
)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import read_torch, write_torch
from megatron.checkpointing.folder import (
    DEEPSPEED,
    MEGATRON,
    CheckpointFolder,
    check_load_dir,
    checkpoint_at,
    find_checkpoint,
    latest_checkpoint,
    make_tmp_folder,
    namings_in,
    no_checkpoint_error,
    publish_checkpoint,
)
from megatron.checkpointing.manifest import build_manifest
from megatron.checkpointing.paths import (
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    mp_rank_dir_name,
)
from megatron.checkpointing.run_config import with_layout
from megatron.config import ConfigError, ModelConfig, ParallelConfig
from megatron.conversion import megatron_deepspeed as mds
from megatron.conversion import optim_state
from megatron.conversion.full_state import (
    FullCheckpoint,
    model_config_from_dict,
    repad_vocab,
    source_config,
)
from megatron.conversion.sharding import (
    chunk_to_full_names,
    chunks_from_layer_counts,
    full_to_chunk_names,
    layer_count,
    merge_tp,
    resize_vocab,
    split_tp,
    tp_piece,
)
from megatron.model.names import TIED_COPY, VOCAB_TENSORS, tp_parts
from megatron.model.placement import Chunk, pipeline_chunks

logger = logging.getLogger(__name__)

# CONVERTED_KEY: the top-level entry of a converted model_optim_rng.pt saying where it came
# from. Its files hold no random-generator state (one rank's generators mean nothing on another
# layout), and loading such a checkpoint starts the generators from --seed instead of asking
# for --no-load-rng.


# Reading -----------------------------------------------------------------------------------


def load_full_checkpoint(load_dir: str, iteration: Optional[int] = None, *,
                         verify: bool = True, true_vocab_size: Optional[int] = None,
                         optimizer: bool = True) -> FullCheckpoint:
    """Read the checkpoint of ``load_dir`` (the tracker's, or ``iteration``'s) at whatever
    tensor/pipeline/virtual-pipeline layout it was saved with, into one ``FullCheckpoint``.

    Reads our checkpoints (checked against their manifest unless ``verify`` is False),
    Megatron-DeepSpeed / Megatron-LM ones (their ``language_model`` layout, model only;
    ``true_vocab_size`` when their flags do not record the unpadded vocabulary), and
    torch_dist folders, Megatron-LM's or ours (``conversion/torch_dist.py``).
    ``optimizer=False`` reads (and checks) the model files only: ``optimizer`` stays None.
    """
    return read_folder(_iteration_folder(load_dir, iteration), verify=verify,
                       true_vocab_size=true_vocab_size, optimizer=optimizer)


def read_checkpoint(load_dir: str, *, verify: bool = True, optimizer: bool = True,
                    true_vocab_size: Optional[int] = None, flag: str = "--load") -> FullCheckpoint:
    """The whole model of ``load_dir``'s latest checkpoint of any kind
    (``checkpointing.folder.find_checkpoint``: ours, Megatron-LM's and Megatron-DeepSpeed's,
    torch_dist, DeepSpeed's engines), as ``read_folder`` reads it; a folder without one is a
    ``CheckpointError`` naming ``flag``."""
    folder = find_checkpoint(load_dir)
    if folder is None:
        raise no_checkpoint_error(load_dir, flag)
    return read_folder(folder, verify=verify, true_vocab_size=true_vocab_size,
                       optimizer=optimizer)


def read_folder(folder: CheckpointFolder, *, verify: bool = True,
                true_vocab_size: Optional[int] = None, optimizer: bool = True) -> FullCheckpoint:
    """One checkpoint folder of any format (``folder.format``) as one ``FullCheckpoint``, by
    that format's reader: torch (here), torch_dist (``conversion/torch_dist.py``), DeepSpeed's
    engines (``conversion/deepspeed_layout.py``); ``verify``, ``optimizer`` and
    ``true_vocab_size`` as for ``load_full_checkpoint``."""
    if folder.format.name == "torch_dist":
        from megatron.conversion.torch_dist import load_torch_dist_checkpoint

        return load_torch_dist_checkpoint(folder, verify=verify,
                                          true_vocab_size=true_vocab_size, optimizer=optimizer)
    if folder.format.name == "deepspeed":
        from megatron.conversion.deepspeed_layout import read_deepspeed_folder

        return read_deepspeed_folder(folder, true_vocab_size, verify=verify,
                                     optimizer=optimizer)
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


def _iteration_folder(load_dir: str, iteration: Optional[int]) -> CheckpointFolder:
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load-dir {load_dir} is not a folder")
    if namings_in(load_dir) == [DEEPSPEED]:
        raise CheckpointError(f"--load-dir {load_dir} holds no {TRACKER_FILENAME}: it looks like "
                              "a DeepSpeed checkpoint: use --loader deepspeed")
    check_load_dir(load_dir)
    if iteration is not None:
        return checkpoint_at(load_dir, iteration)
    folder = latest_checkpoint(load_dir)
    if folder is None:
        hint = "pass the folder a training run saved into (its --save)"
        if os.path.isfile(os.path.join(load_dir, "config.json")):
            hint = "it looks like a Hugging Face model: use --loader hf"
        raise CheckpointError(f"--load-dir {load_dir} holds no {TRACKER_FILENAME}: {hint}")
    return folder


def _chunk_states(state: dict, theirs: bool, path: str) -> list[dict]:
    """The model chunks of one file under our chunk names (checked to number their layers
    from 0)."""
    keys = sorted((k for k in state if k == "model" or (k.startswith("model") and k[5:].isdigit())),
                  key=lambda k: int(k[5:] or 0))
    try:
        if not keys:
            raise ValueError("it holds no model ('model' entry)")
        chunks = [mds.our_names(state[k]) if theirs else state[k] for k in keys]
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
            per_rank[(t, p)], meta = _named_torch_state(state["optimizer"], chunk_states[(t, p)],
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


def _named_torch_state(saved: dict, chunks: list[dict], where: str) -> tuple[list[dict], dict]:
    """Per chunk ``{chunk name: state}`` from a rank's torch (or mixed-precision) optimizer."""
    mixed = "fp32_from_fp16_params" in saved
    torch_sd = saved["optimizer"] if mixed else saved
    names = [(f"{i}/{name}", value.shape) for i, chunk in enumerate(chunks)
             for name, value in chunk.items()]
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


# Writing -----------------------------------------------------------------------------------


def save_full_checkpoint(full: FullCheckpoint, save_dir: str, tp: int = 1, pp: int = 1, *,
                         num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                         use_distributed_optimizer: Optional[bool] = None,
                         source: str = "") -> str:
    """Write ``full`` into ``save_dir`` at tensor-parallel size ``tp`` and pipeline size
    ``pp`` (interleaved with ``num_layers_per_virtual_pipeline_stage``), as our training saves
    it: ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` (``release/`` for a release
    checkpoint), ``distrib_optim.pt`` with the distributed optimizer (default: as the source),
    ``manifest.json`` and the tracker file, written to a temporary folder and renamed into
    place. Returns the iteration folder. The vocabulary is re-padded for ``tp`` (rows past
    the true vocabulary are padding: zero where new). No random-generator state is written.
    """
    distributed = full.distributed_optimizer if use_distributed_optimizer is None \
        else use_distributed_optimizer
    chunks = _target_chunks(full, tp, pp, num_layers_per_virtual_pipeline_stage)
    config = with_layout(full.config, tp, pp, num_layers_per_virtual_pipeline_stage,
                         distributed if full.optimizer is not None else None)
    cut = LayoutCut(full, tp, config, distributed=distributed, mixed=mixed_precision(config),
                    source=source or "a full checkpoint")
    files = {}
    for t in range(tp):
        for p in range(pp):
            folder = mp_rank_dir_name(t, p, pp)
            state, distrib = cut.rank_files(chunks[p], t, pp)
            files[f"{folder}/{MODEL_FILENAME}"] = state
            if distrib is not None:
                files[f"{folder}/{DISTRIB_OPTIM_FILENAME}"] = distrib
    return _write_folder(save_dir, full, config, files, len(chunks[0]))


class LayoutCut:
    """``full`` prepared to be cut for the ranks of tensor-parallel size ``tp`` (vocabulary
    padded for it, optimizer state split): ``rank_files`` gives one (tensor, pipeline) rank's
    ``model_optim_rng.pt`` dict and, with the distributed optimizer, ``distrib_optim.pt``'s,
    as training at that layout saves them. ``config``: the run configuration they record;
    ``mixed``: the optimizer keeps fp32 main copies (``MixedPrecisionOptimizer``'s format).
    ``save_full_checkpoint`` writes every rank's; loading a format read whole (a universal
    checkpoint) builds this rank's only, from the parameters it holds."""

    def __init__(self, full: FullCheckpoint, tp: int, config: dict, *, distributed: bool,
                 mixed: bool, source: str) -> None:
        self.full, self.tp, self.config, self.source = full, tp, config, source
        self.distributed, self.mixed = distributed, mixed
        model_config = model_config_from_dict(config.get("model", {}), tp)
        self.model_config = model_config
        self.tied = not model_config.untie_embeddings_and_output_weights
        self.padded = repad_vocab(full.model, model_config.padded_vocab_size)
        self.opt_pieces = _optimizer_pieces(full, model_config, tp, distributed or mixed)

    def rank_files(self, chunks: list[Chunk], tp_rank: int,
                   pp: int) -> tuple[dict, Optional[dict]]:
        """The files of tensor rank ``tp_rank`` of the pipeline stage holding ``chunks``
        (one per virtual stage; ``pp``: the pipeline size)."""
        full = self.full
        chunk_models = rank_chunk_models(self.padded, self.model_config, self.tp, tp_rank,
                                         chunks)
        optimizer, distrib = None, None
        if self.opt_pieces is not None:
            rank_opt = {k: {key: v[tp_rank] for key, v in e.items()}
                        for k, e in self.opt_pieces.items()}
            chunk_opts = [full_to_chunk_names(rank_opt, c, self.tied) for c in chunks]
            if self.distributed:
                distrib = optim_state.gathered_from_named(chunk_opts, full.optimizer)
            else:
                optimizer = _torch_optimizer(full.optimizer, chunk_models, chunk_opts,
                                             self.mixed)
        state = rank_file_state(
            iteration=full.iteration, config=self.config,
            parallel_layout=layout_dict(self.tp, pp, 1, len(chunk_models)),
            consumed=(full.consumed_train_samples, full.consumed_valid_samples),
            models=chunk_models, optimizer=optimizer, distributed_optimizer=distrib is not None,
            scheduler=full.scheduler, converted_from=self.source, extra=full.extra)
        return state, distrib


def rank_chunk_models(model: dict, config: ModelConfig, tp: int, tp_rank: int,
                      chunks: list[Chunk]) -> list[dict]:
    """The state dicts of tensor rank ``tp_rank``'s model ``chunks`` (one pipeline stage, one
    per virtual stage), from a full model of ``config`` whose vocabulary is padded for
    ``tp``: what ``GPTModel`` built for each chunk at that rank loads."""
    tied = not config.untie_embeddings_and_output_weights
    return [{k: tp_piece(k, v, tp, tp_rank, tp_parts(k, config))
             for k, v in full_to_chunk_names(model, chunk, tied).items()} for chunk in chunks]


def _target_chunks(full: FullCheckpoint, tp: int, pp: int,
                   layers_per_virtual_stage: Optional[int]) -> list[list[Chunk]]:
    """The chunks of each target pipeline stage, after checking the layout fits the model
    as training would (heads and MLP over tp, layers over pp and virtual stages)."""
    num_layers = full.config["model"]["num_layers"]
    try:
        full.model_config(tp)
        parallel = ParallelConfig(world_size=tp * pp, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp,
                                  num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage)
        vp = parallel.check_virtual_pipeline(num_layers)
        if layers_per_virtual_stage is not None and vp is None:
            raise ConfigError(f"{layers_per_virtual_stage} layers per virtual stage is the "
                              f"whole stage ({num_layers} layers over {pp} stages): drop it")
        return pipeline_chunks(num_layers, pp, vp)
    except ConfigError as error:
        raise ValueError(f"cannot save at tensor-parallel size {tp}, pipeline size {pp}: "
                         f"{error}") from None


def mixed_precision(config: dict) -> bool:
    """Whether a run with this configuration (plain dicts) keeps fp32 main copies in its
    optimizer (fp16/bf16, or a loss scale)."""
    opt = config.get("optimizer", {})
    model = config.get("model", {})
    return bool(model.get("fp16") or model.get("bf16") or opt.get("fp16") or opt.get("bf16")
                or opt.get("loss_scale") is not None)


def _optimizer_pieces(full: FullCheckpoint, config: ModelConfig, tp: int,
                      needs_mains: bool) -> Optional[dict]:
    if full.optimizer is None:
        return None
    rows = config.padded_vocab_size
    out = {}
    for name, entry in full.optimizer["param_state"].items():
        entry = dict(entry)
        if needs_mains and "param" not in entry:
            entry["param"] = full.model[name].float()
        if name in VOCAB_TENSORS:
            entry = {k: resize_vocab(v, rows) for k, v in entry.items()}
        out[name] = {k: split_tp(name, v, tp, tp_parts(name, config)) for k, v in entry.items()}
    return out


def _torch_optimizer(full_opt: dict, chunk_models: list[dict], chunk_opts: list[dict],
                     mixed: bool) -> dict:
    names = [(f"{i}/{n}", v.shape) for i, c in enumerate(chunk_models) for n, v in c.items()]
    state = {f"{i}/{n}": e for i, c in enumerate(chunk_opts) for n, e in c.items()}
    torch_sd = optim_state.torch_from_named(state, full_opt["param_groups"], full_opt["step"],
                                            names)
    if not mixed:
        return torch_sd
    dtype = {f"{i}/{n}": v.dtype for i, c in enumerate(chunk_models) for n, v in c.items()}
    mains = [[state[k]["param"] for k in group if dtype[k] != torch.float32]
             for group in optim_state.group_param_names(names)]
    return {"optimizer": torch_sd, "grad_scaler": full_opt.get("grad_scaler"),
            "fp32_from_fp16_params": mains}


def _write_folder(save_dir: str, full: FullCheckpoint, config: dict, files: dict,
                  num_chunks: int) -> str:
    """Write ``files`` (relative path -> dict) into a temporary folder, then publish it with
    its manifest and point the tracker at it (``megatron.checkpointing.folder``)."""
    name = MEGATRON.folder_name(full.iteration, full.release)
    tmp = make_tmp_folder(save_dir, name)
    try:
        digests = {}
        for rel, obj in files.items():
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            digests[rel] = write_torch(obj, os.path.join(tmp, rel))
        layout = config["parallel"]
        manifest = build_manifest(
            full.iteration, layout_dict(layout["tensor_model_parallel_size"],
                                        layout["pipeline_model_parallel_size"], 1, num_chunks),
            config, digests)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_checkpoint(save_dir, tmp, full.iteration, manifest, release=full.release)

"""DeepSpeed engine checkpoints (model weights), read into a ``FullCheckpoint``.

DeepSpeed's ``engine.save_checkpoint(DIR)`` writes ``DIR/latest`` (``global_stepN``) and::

    global_stepN/mp_rank_{r:02d}_model_states.pt          the engine's state and the client
                                                           state (Megatron's args/config,
                                                           iteration); ``module``: the model's
                                                           state dict, or None with a pipeline.
                                                           ``r`` is the tensor rank, or with a
                                                           pipeline the model-parallel rank
                                                           (stage x tensor): one per stage
    global_stepN/layer_{i:02d}[-model_{tp:02d}]-model_states.pt  PipelineModule: one file per
                                                           layer (index in the layer specs)
    global_stepN/zero_pp_rank_{d}_mp_rank_{r:02d}_model_states.pt  ZeRO-3 instead of
                                                           mp_rank_*: ``module`` holds empty
                                                           placeholders; the weights are in
    global_stepN/zero_pp_rank_{d}_mp_rank_{r:02d}_optim_states.pt  ZeRO's fp32 partitions

This was checked against checkpoints written by our ``--deepspeed`` engine (DeepSpeed 0.19;
tests/distributed/test_deepspeed_engine.py): ZeRO 1 at tp 1 and 2, ZeRO 3 (gathered with DeepSpeed's
``zero_to_fp32``; tp 1 only) and the pipeline engine at pp 2.

A pipeline's layer files are told apart by their entries, as Megatron-DeepSpeed's
``GPTModelPipe`` lays them out: the embedding (``word_embeddings.weight``; its second, tied
appearance as the LM head is skipped), transformer layers in order (``input_layernorm.*``,
``self_attention.*``, ``mlp.*``), the final layer norm (1-D ``weight``/``bias``) and, untied, an
output layer (a 2-D ``weight``). Our own ``TransformerLayerPipe`` files name their entries
``layers.0.*`` (one layer of a ``ParallelTransformer``): that prefix is dropped. The model, the
iteration, consumed samples and (from our engine's client state) the LR schedule are read,
and at ZeRO 1/2 the optimizer state too (``zero_optim``; the pipeline engine's at tp 1 only), so
training resumes exactly; ZeRO-3's optimizer state is not converted (train on with
--no-load-optim or --finetune).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from megatron.checkpointing.contents import consumed_samples, stored_config
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import read_torch
from megatron.checkpointing.folder import (
    DEEPSPEED,
    CheckpointFolder,
    checkpoint_at,
    latest_checkpoint,
)
from megatron.checkpointing.formats.deepspeed.files import (
    deepspeed_model_state_files,
    zero3_full_weights,
)
from megatron.checkpointing.formats.deepspeed.zero_optim import read_zero_optimizer
from megatron.checkpointing.full_state import (
    FullCheckpoint,
    model_config_from_dict,
    repad_vocab,
    source_config,
)
from megatron.checkpointing.run_config import is_our_config
from megatron.model import megatron_deepspeed as mds
from megatron.model.names import OUTPUT_LAYER, TIED_COPY, WORD_EMBEDDINGS, layer_key, tp_parts
from megatron.model.sharding import merge_tp

_ZERO3_FILE_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt")
# DeepSpeed names the tensor ("model") rank only when the topology has that axis.
_LAYER_FILE_RE = re.compile(r"layer_(\d+)(?:-model_(\d{2}))?-model_states\.pt")
# DeepSpeed-MoE's own files: each expert of each layer alone.
_EXPERT_FILE_RE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d{2})_model_states\.pt")
_DS_MOE_NAME_RE = re.compile(r"(.*\.mlp\.)moe\.deepspeed_moe\."
                             r"(?:gate\.wg\.weight|experts\.deepspeed_experts\.(\d+)\.(.+))")
_OLD_ATTENTION_RE = re.compile(r"(^|\.)attention\.")  # older Megatron's name of self_attention
_PIPE_LAYER_PREFIX_RE = re.compile(r"^layers\.\d+\.")  # our TransformerLayerPipe's own prefix


def load_deepspeed_checkpoint(load_dir: str, iteration: Optional[int] = None,
                              true_vocab_size: Optional[int] = None, *, verify: bool = True,
                              optimizer: bool = True) -> FullCheckpoint:
    """The model of a DeepSpeed checkpoint folder (``latest``'s step, or ``iteration``'s).

    The files read are checked against the folder's manifest first (our ``--deepspeed``
    saves write one) unless ``verify`` is False. ``optimizer=False`` reads the model only
    (``optimizer`` stays None)."""
    return read_deepspeed_folder(step_folder(load_dir, iteration), true_vocab_size,
                                 verify=verify, optimizer=optimizer)


def read_deepspeed_folder(folder: CheckpointFolder, true_vocab_size: Optional[int] = None, *,
                          verify: bool = True, optimizer: bool = True) -> FullCheckpoint:
    """``load_deepspeed_checkpoint`` of one step folder (``checkpointing.folder``'s)."""
    step_dir = folder.path
    mp_files, zero3_files = deepspeed_model_state_files(step_dir)
    if verify and folder.manifest is not None:
        # ZeRO-3 keeps its weights in the optimizer's partitions.
        with_optimizer = optimizer or not mp_files
        folder.verify([f for f in folder.manifest["files"]
                       if with_optimizer or "optim_states" not in f], checksums=True)
    first_name = mp_files[0] if mp_files else zero3_files[0]
    first = read_torch(os.path.join(step_dir, first_name))
    theirs = not is_our_config(stored_config(first))
    config = source_config(first, theirs, true_vocab_size, os.path.join(step_dir, first_name))
    layer_files = [m for m in map(_LAYER_FILE_RE.fullmatch, sorted(os.listdir(step_dir))) if m]
    states = [read_torch(os.path.join(step_dir, n)) for n in mp_files]
    if layer_files:
        tp_ranks = sorted({int(m.group(2) or 0) for m in layer_files})
        per_tp = [_pipeline_model(step_dir, [m for m in layer_files if int(m.group(2) or 0) == t])
                  for t in tp_ranks]
    elif mp_files:
        per_tp = [_module(state, os.path.join(step_dir, n)) for state, n in zip(states, mp_files)]
        expert_files = [n for n in sorted(os.listdir(step_dir)) if _EXPERT_FILE_RE.fullmatch(n)]
        if expert_files:
            per_tp = [_with_deepspeed_experts(per_tp[0], step_dir, expert_files)]
    else:
        per_tp = [_zero3_module(folder.root, step_dir, zero3_files)]
    model_config = model_config_from_dict(config["model"])
    padded = model_config.padded_vocab_size
    model = {name: merge_tp(name, [rank[name] for rank in per_tp], tp_parts(name, model_config))
             for name in per_tp[0]}
    model = repad_vocab(model, padded)
    optimizer_state = None
    # DeepSpeed-MoE's optimizer partitions are grouped its own way: the weights only.
    if optimizer and mp_files and not theirs and not _has_expert_files(step_dir):
        if not layer_files:  # ZeRO 1/2 partitions under our names
            optimizer_state = read_zero_optimizer(step_dir, states, model_config)
        elif len(tp_ranks) == 1:  # the pipeline's, one per stage
            optimizer_state = read_zero_optimizer(step_dir, states, model_config,
                                                  stages=len(mp_files))
    train, valid = consumed_samples(first)
    return FullCheckpoint(
        config=config, model=model, optimizer=optimizer_state,
        iteration=int(first.get("iteration", first.get("global_steps", 0))),
        consumed_train_samples=train or int(first.get("global_samples", 0) or 0),
        consumed_valid_samples=valid,
        scheduler=None if theirs else first.get("opt_param_scheduler"))


def _has_expert_files(step_dir: str) -> bool:
    return any(_EXPERT_FILE_RE.fullmatch(n) for n in os.listdir(step_dir))


def _with_deepspeed_experts(model: dict, step_dir: str, files: list[str]) -> dict:
    """A DeepSpeed-MoE model (tensor-parallel size 1) under our names: its gate as the
    router, its experts (each saved in a file of its own, under its global number) as our
    experts."""
    model = dict(model)
    for name in files:
        if _EXPERT_FILE_RE.fullmatch(name).group(3) != "00":
            raise CheckpointError(f"{step_dir}/{name}: DeepSpeed-MoE at tensor-parallel size "
                                  "above 1 does not convert")
        model.update(read_torch(os.path.join(step_dir, name)))
    out = {}
    for key, value in model.items():
        m = _DS_MOE_NAME_RE.fullmatch(key)
        if m is None and ".mlp.moe." in key:
            raise CheckpointError(f"{step_dir}: {key} (DeepSpeed-MoE's residual MLP, "
                                  "--mlp-type residual) has no place in our model")
        if m is None:
            out[key] = value
        elif m.group(2) is None:
            out[m.group(1) + "router.weight"] = value
        else:
            out[f"{m.group(1)}local_experts.{m.group(2)}.{m.group(3)}"] = value
    return out


def step_folder(load_dir: str, iteration: Optional[int] = None) -> CheckpointFolder:
    """The ``global_stepN`` folder of ``load_dir`` that ``latest`` (or ``iteration``) names."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load-dir {load_dir} is not a folder")
    if iteration is not None:
        return checkpoint_at(load_dir, iteration, naming=DEEPSPEED)
    folder = latest_checkpoint(load_dir, DEEPSPEED)
    if folder is None:
        raise CheckpointError(f"--load-dir {load_dir} holds no '{DEEPSPEED.tracker}' file (nor "
                              "a complete global_stepN folder): pass the folder DeepSpeed "
                              "saved into, or --iteration N")
    return folder


def _module(state: dict, path: str) -> dict:
    module = state.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{path} holds no model ('module') and its folder no layer_*"
                              "-model_states.pt files")
    named = mds.MDS.to_ours(module, None) if any(k.startswith("language_model.") for k in module) \
        else dict(module)
    named.pop(TIED_COPY, None)
    return named


def _zero3_module(load_dir: str, step_dir: str, files: list) -> dict:
    """ZeRO-3's model, gathered from its fp32 partitions (tensor-parallel size 1 only)."""
    tp_ranks = {_ZERO3_FILE_RE.fullmatch(n).group(2) for n in files}
    if len(tp_ranks) > 1:
        raise CheckpointError(f"{step_dir} is a ZeRO-3 checkpoint at tensor-parallel size "
                              f"{len(tp_ranks)}: only tp 1 ZeRO-3 checkpoints convert (DeepSpeed's "
                              "zero_to_fp32, which gathers the partitions, reads tensor rank 0 "
                              "alone); ZeRO 0-2 checkpoints convert at any tp")

    try:
        module = zero3_full_weights(load_dir, os.path.basename(step_dir))
    except (FileNotFoundError, ValueError, KeyError) as error:
        raise CheckpointError(f"{step_dir}: cannot gather ZeRO-3's partitions: {error}") from error
    return _module({"module": module}, os.path.join(step_dir, files[0]))


def _pipeline_model(step_dir: str, files: list) -> dict:
    """One tensor rank's model from its layer files, in layer-index order, under full names."""
    out: dict = {}
    layer = 0
    for m in sorted(files, key=lambda m: int(m.group(1))):
        path = os.path.join(step_dir, m.group(0))
        state = {_OLD_ATTENTION_RE.sub(r"\1self_attention.", _PIPE_LAYER_PREFIX_RE.sub("", k)): v
                 for k, v in read_torch(path).items()}
        if "word_embeddings.weight" in state:
            if WORD_EMBEDDINGS not in out:
                out.update({f"embedding.{k}": v for k, v in state.items()})
        elif "input_layernorm.weight" in state:
            out.update({layer_key(layer, k): v for k, v in state.items()})
            layer += 1
        elif state and all(k.startswith("final_layernorm.") for k in state):  # ours
            out.update(state)
        elif set(state) <= {"weight", "bias"} and state["weight"].dim() == 1:
            out.update({f"final_layernorm.{k}": v for k, v in state.items()})
        elif set(state) == {"weight"}:
            out[OUTPUT_LAYER] = state["weight"]
        elif set(state) == {"lm_head.weight"}:  # ours and Megatron-DeepSpeed's LMHeadPipe
            out[OUTPUT_LAYER] = state["lm_head.weight"]
        else:
            raise CheckpointError(f"{path}: cannot tell which layer it is (entries "
                                  f"{sorted(state)[:6]})")
    return out

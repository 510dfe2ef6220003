"""DeepSpeed's universal checkpoints (``ds_to_universal.py``'s folders) read as ours.

The folder itself is ``megatron/checkpointing/formats/deepspeed/universal_folder.py``'s. Here:

- ``full_names``: its parameter names (``zero/<name>``) as ours. It holds the engine's names:
  our plain model's (ours already), our pipeline module's (``tied_modules.embed.*``,
  ``{i}.layers.0.*``, ``{i}.final_layernorm.*``), Megatron-DeepSpeed's plain model's
  (``language_model.*``) or its ``GPTModelPipe``'s (``{i}.input_layernorm.weight``, ...,
  ``{i}.weight`` for the final norm, ``{i}.lm_head.weight``).
- ``read_universal``: the folder (or the parameters one rank needs) as a ``FullCheckpoint``:
  each ``fp32.pt`` the model and the fp32 main copy, ``exp_avg``/``exp_avg_sq`` Adam's
  moments, ``step.pt`` the step, ``zero/optimizer_state.pt`` the hyper-parameters; iteration,
  consumed samples and (ours) the LR schedule from the copied model-state file. Vocabulary
  tensors, stored without padding, are padded with zero rows.
- ``load_universal_checkpoint``: ``--load`` of one into the built-in engine at any
  tensor/pipeline/data layout: this rank's parameters are read and cut by the same code that
  writes converted checkpoints (``formats.torch.cut.LayoutCut``), then loaded as a checkpoint
  file of this layout would be (``formats.torch.load.load_built_state``).
- For ``--deepspeed`` (``integrations/deepspeed/``): ``universal_checkpoint_info``, the
  description our DeepSpeed saves carry so that ``ds_to_universal.py`` joins tensor-parallel
  pieces as our model cuts them, and ``engine_names`` / ``check_engine_files``.

Rows past the true vocabulary (padding) are not in a universal checkpoint: they start at zero.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import torch
from torch import nn

from megatron.checkpointing import optim_state
from megatron.checkpointing.contents import as_chunks, config_dict, consumed_samples, stored_config
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.deepspeed.files import pickled_classes
from megatron.checkpointing.formats.deepspeed.universal_folder import STATE_KEYS, UniversalFolder
from megatron.checkpointing.formats.deepspeed.zero_optim import our_name
from megatron.checkpointing.formats.torch.cut import LayoutCut, mixed_precision
from megatron.checkpointing.formats.torch.load import load_built_state
from megatron.checkpointing.full_state import FullCheckpoint, model_config_from_dict, source_config
from megatron.checkpointing.model_shape import check_model_shape, saved_model_fields
from megatron.checkpointing.ranks import raise_together
from megatron.checkpointing.run_config import is_our_config
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.optimizer import shards_state
from megatron.core.tensor_parallel.layers import assume_tensor_parallel_rank
from megatron.model import megatron_deepspeed as mds
from megatron.model.gpt_model import GPTModel
from megatron.model.names import (
    OUTPUT_LAYER,
    TIED_COPY,
    VOCAB_TENSORS,
    WORD_EMBEDDINGS,
    layer_key,
    tp_parts,
    tp_split_dim,
)
from megatron.model.placement import stage_chunks
from megatron.model.sharding import chunk_to_full_names, resize_vocab, tp_piece
from megatron.platform.output import print_rank_0

_OURS_RE = re.compile(r"(embedding\.|encoder\.layers\.\d+\.|final_layernorm\.|output_layer\.)")
_PIPE_RE = re.compile(r"(\d+)\.(.+)")
_TIED = "tied_modules.embed."
_OUR_LAYER_PREFIX = "layers.0."  # our TransformerLayerPipe holds one layer of a transformer


# Names -------------------------------------------------------------------------------------


def full_names(names: list[str], where: str) -> dict[str, str]:
    """Our full name -> the folder's name, for every parameter ``names`` lists; a
    ``CheckpointError`` naming ``where`` for a name of no known model."""
    try:
        if all(_OURS_RE.match(n) for n in names):
            return {n: n for n in names}
        if all(n.startswith("language_model.") for n in names):
            return {ours: theirs for ours, theirs in mds.our_names({n: n for n in names}).items()}
        return _pipeline_names(names)
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from None


def _pipeline_names(names: list[str]) -> dict[str, str]:
    """A pipeline module's names, told apart by what each layer spec holds (our
    ``TransformerLayerPipe``'s ``layers.0.`` prefix dropped), as ours."""
    specs: dict[int, dict[str, str]] = {}
    out = {}
    for name in names:
        if name.startswith(_TIED):
            out["embedding." + name.removeprefix(_TIED)] = name
            continue
        m = _PIPE_RE.fullmatch(name)
        if m is None:
            raise ValueError(f"parameter {name!r} is not one of a GPT pipeline module's")
        specs.setdefault(int(m.group(1)), {})[m.group(2).removeprefix(_OUR_LAYER_PREFIX)] = name
    layer = 0
    for index in sorted(specs):
        entries = specs[index]
        if "input_layernorm.weight" in entries:
            out.update({layer_key(layer, k): v for k, v in entries.items()})
            layer += 1
        elif "word_embeddings.weight" in entries:  # an untied embedding
            out.update({f"embedding.{k}": v for k, v in entries.items()})
        elif all(k.startswith("final_layernorm.") for k in entries):  # ours
            out.update(entries)
        elif set(entries) <= {"weight", "bias"}:  # Megatron-DeepSpeed's final norm
            out.update({f"final_layernorm.{k}": v for k, v in entries.items()})
        elif set(entries) == {"lm_head.weight"}:
            out["output_layer.weight"] = entries["lm_head.weight"]
        else:
            raise ValueError(f"pipeline layer {index} ({', '.join(sorted(entries.values()))}) "
                             "is not one of GPT's layers")
    return out


def engine_names(module: nn.Module, pipeline: bool) -> dict[str, str]:
    """DeepSpeed's engine's parameter name (``module.named_parameters()``) -> our full name:
    the plain model's are ours; the pipeline module's as ``zero_optim.our_name`` maps them."""
    return {n: our_name(n) if pipeline else n for n, _ in module.named_parameters()}


def chunk_full_names(chunk_state_names: list[str], chunk: Any) -> list[str]:
    """The full names a model chunk's state dict entries stand for (the last stage's tied
    copy stands for the word embeddings)."""
    named = chunk_to_full_names({n: n for n in chunk_state_names}, chunk)
    return sorted({WORD_EMBEDDINGS if k == TIED_COPY else k for k in named})


# Reading -----------------------------------------------------------------------------------


def read_universal(folder: UniversalFolder, *, optimizer: bool = True,
                   names: Optional[list[str]] = None,
                   true_vocab_size: Optional[int] = None) -> FullCheckpoint:
    """The universal checkpoint ``folder`` as one ``FullCheckpoint`` (tp 1, one stage; the
    vocabulary padded for tp 1): every parameter, or only the full ``names`` given.
    ``optimizer=False``: the model only. A parameter the folder lacks, or a file that is
    missing or unreadable, is a ``CheckpointError`` naming it."""
    common = folder.common
    theirs = not is_our_config(stored_config(common))
    config = source_config(common, theirs, true_vocab_size, folder.path)
    mapping = full_names(folder.param_dirs(), folder.zero_dir)
    shapes = expected_shapes(config["model"])
    wanted = sorted(mapping) if names is None else names
    if names is None:
        for name in shapes:  # every parameter of the checkpoint's model has its folder
            _dir_of(mapping, name, folder)
    rows = model_config_from_dict(config["model"]).padded_vocab_size
    model, param_state, step = {}, {}, None
    for name in wanted:
        param = _dir_of(mapping, name, folder)
        model[name] = _whole(folder, param, "fp32", name, shapes, rows)
        if optimizer:
            param_state[name] = {"param": model[name], **{
                k: _whole(folder, param, k, name, shapes, rows) for k in STATE_KEYS[1:]}}
            found = folder.read_step(param)
            step = found if found is not None else step
    optimizer_state = None
    if optimizer:
        saved = _optimizer_state(folder)
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in saved.get("param_groups", [])]
        optimizer_state = {"param_groups": groups, "step": _step(saved) if step is None else step,
                           "param_state": param_state, "grad_scaler": None}
    train, valid = _consumed(common)
    return FullCheckpoint(
        config=config, model=model, optimizer=optimizer_state,
        iteration=int(common.get("iteration", common.get("global_steps", 0)) or 0),
        consumed_train_samples=train, consumed_valid_samples=valid,
        scheduler=None if theirs else common.get("opt_param_scheduler"))


def _optimizer_state(folder: UniversalFolder) -> dict:
    return folder.optimizer_state(pickled_classes())


def _step(saved: dict) -> Optional[float]:
    """The step in ``zero/optimizer_state.pt`` (ZeRO-3's conversions write no step.pt): its
    base optimizer's state, as DeepSpeed's ZeRO-3 load reads it."""
    state = (saved.get("optimizer_state_dict") or {}).get("state") or {}
    for entry in state.values():
        if isinstance(entry, dict) and "step" in entry:
            step = entry["step"]
            return float(step.item() if isinstance(step, torch.Tensor) else step)
    return None


def _consumed(common: dict) -> tuple[int, int]:
    train, valid = consumed_samples(common)
    return train or int(common.get("global_samples", 0) or 0), valid


def _dir_of(mapping: dict, name: str, folder: UniversalFolder) -> str:
    if name not in mapping:
        raise CheckpointError(f"universal checkpoint {folder.zero_dir} has no parameter folder "
                              f"for {name} (it holds {len(mapping)} parameters): "
                              "ds_to_universal.py did not finish, or a folder was removed")
    return mapping[name]


def _whole(folder: UniversalFolder, param: str, key: str, name: str, shapes: dict,
           rows: int) -> torch.Tensor:
    """``zero/<param>/<key>.pt``'s tensor in the shape of the full parameter ``name``
    (``shapes``: the model's), a vocabulary padded to ``rows``."""
    path = folder.file(param, key)
    tensor = folder.read_state(param, key)["param"]
    return _fit_vocab(name, _unflatten(tensor, shapes.get(name, tensor.shape), path), rows, path)


def _fit_vocab(name: str, tensor: torch.Tensor, rows: int, path: str) -> torch.Tensor:
    """The vocabulary tensors (stored unpadded) padded with zero rows to ``rows``."""
    if name not in VOCAB_TENSORS:
        return tensor
    if tensor.size(0) > rows:
        raise CheckpointError(f"{path}: {tensor.size(0)} vocabulary rows, more than the {rows} "
                              "this model has")
    return resize_vocab(tensor, rows)


def _unflatten(tensor: torch.Tensor, shape: Any, path: str) -> torch.Tensor:
    """A tensor stored flat (ZeRO-3's conversions keep each parameter 1-D) in rows of
    ``shape[1:]`` (a vocabulary's row count may differ: padding)."""
    if tensor.dim() != 1 or len(shape) < 2:
        return tensor
    row = math.prod(shape[1:])
    if tensor.numel() % row:
        raise CheckpointError(f"{path} holds {tensor.numel()} values, not rows of "
                              f"{tuple(shape[1:])}")
    return tensor.view(-1, *shape[1:])


def expected_shapes(model: Any) -> dict[str, torch.Size]:
    """The full names and shapes (tp 1) of the parameters of a GPT of ``model`` (a
    ``ModelConfig``, or its fields as a dict), built on the meta device: no memory."""
    import dataclasses


    config = model_config_from_dict(model if isinstance(model, dict)
                                    else dataclasses.asdict(model))
    # Whole tensors whatever this process's groups are.
    with torch.device("meta"), assume_tensor_parallel_rank(1, 0):
        built = GPTModel(config)
    return {n: p.shape for n, p in built.named_parameters()}


# Checks against the run ----------------------------------------------------------------------


def check_against_run(folder: UniversalFolder, model_config: Any) -> None:
    """The folder's model has this run's shapes (its padding aside: any layout pads the
    vocabulary its own way), and its vocabulary fits."""
    saved = stored_config(folder.common)
    fields = saved_model_fields(saved)
    unpadded = {k: v for k, v in fields.items()
                if k not in ("padded_vocab_size", "make_vocab_size_divisible_by",
                             "tensor_model_parallel_size", "vocab_size")}
    where = f"{folder.path} (--load {folder.load_dir})"
    check_model_shape(unpadded, model_config, where)
    info = folder.common.get("universal_checkpoint_info") or {}
    theirs = info.get("original_vocab_size") or fields.get("vocab_size")
    if isinstance(theirs, int) and theirs != model_config.vocab_size:
        raise CheckpointError(f"checkpoint {where} has a vocabulary of {theirs} tokens, this "
                              f"run's tokenizer {model_config.vocab_size}: run with the "
                              "checkpoint's tokenizer")


# Our DeepSpeed saves ---------------------------------------------------------------------------

# DeepSpeed's names (deepspeed/checkpoint/constants.py) of what ds_to_universal.py reads.
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
_VOCABULARY = "vocabulary_parameter_patterns"
_PIPELINE_REPLICATED = "pipeline_replicated_parameter_patterns"
_TP_REPLICATED = "tp_replicated_parameter_patterns"
_ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
# SwiGLU's first projection: each rank holds [gate_r; up_r], merged as [gate; up]
_TWO_PARTS = "parameter_with_2_sub_params_cat_dim_0"


def universal_checkpoint_info(model_config: Any, pipeline: bool) -> dict:
    """What our DeepSpeed checkpoints tell ``ds_to_universal.py`` (as Megatron-DeepSpeed's
    do), for the model of ``model_config`` in the plain engine or (``pipeline``) in our
    pipeline module: which parameters are replicated over tensor-parallel ranks, which are
    cut along their columns (row-parallel), which are vocabulary tensors (their padding is
    dropped: ``original_vocab_size`` rows are kept) and, in the pipeline module, which
    appear on two stages (the tied embedding), and which hold two parts cut on their own
    (SwiGLU's ``[gate; up]``: ``names.tp_parts``). Every other parameter was cut along its
    rows. The rule is ``names.tp_split_dim``'s; the patterns cover every stage's parameters,
    layer numbers written ``\\d+``."""
    by_kind: dict[str, list[str]] = {_VOCABULARY: [], _PIPELINE_REPLICATED: [],
                                     _TP_REPLICATED: [], _ROW_PARALLEL: [], _TWO_PARTS: []}
    for full in expected_shapes(model_config):
        engine_name = _pipeline_name(full, model_config) if pipeline else full
        pattern = r"\.".join(r"\d+" if part.isdigit() else re.escape(part)
                              for part in engine_name.split(".")) + "$"
        dim = tp_split_dim(full)
        kind = _TP_REPLICATED if dim is None else _ROW_PARALLEL if dim == 1 else None
        if tp_parts(full, model_config) == 2:
            kind = _TWO_PARTS
        for key, member in ((kind, kind is not None), (_VOCABULARY, full in VOCAB_TENSORS),
                            (_PIPELINE_REPLICATED, engine_name.startswith(_TIED))):
            if member and pattern not in by_kind[key]:
                by_kind[key].append(pattern)
    return {**by_kind, "original_vocab_size": model_config.vocab_size,
            "padded_vocab_size": model_config.padded_vocab_size}


def _pipeline_name(full: str, model_config: Any) -> str:
    """Our pipeline module's name of a full name (``zero_optim.our_name`` backwards; the
    layer numbers only need to be numbers: the patterns match any). Untied, the embedding is
    layer spec 0 and the LM head (``lm_head.weight``) the last."""
    untied = model_config.untie_embeddings_and_output_weights
    if full.startswith("embedding."):
        return ("0." if untied else _TIED) + full.removeprefix("embedding.")
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", full)
    if m:
        return f"{int(m.group(1)) + 1}.{_OUR_LAYER_PREFIX}{m.group(2)}"
    if full == OUTPUT_LAYER:
        return f"{model_config.num_layers + 2}.lm_head.weight"
    return f"0.{full}"  # final_layernorm.*


def check_engine_files(folder: UniversalFolder, names: dict[str, str],
                       shapes: dict[str, torch.Size], tp: int, optimizer: bool) -> dict[str, str]:
    """Before DeepSpeed's engine reads ``folder``: each of this rank's parameters (``names``:
    the engine's -> ours; ``shapes``: this rank's piece's) has its files, readable, with the
    whole tensor this layout cuts its piece from, and was joined along the dimension our
    model cuts it (a tensor-parallel size 1 Megatron-DeepSpeed checkpoint records none).
    Returns the engine's name -> the folder's, for the engine to read by."""
    mapping = full_names(folder.param_dirs(), folder.zero_dir)
    out = {}
    for engine_name, full in names.items():
        param = _dir_of(mapping, full, folder)
        out[engine_name] = param
        for key in STATE_KEYS if optimizer else STATE_KEYS[:1]:
            state = folder.read_state(param, key, mmap=True)
            _check_piece(folder.file(param, key), full, state, shapes[engine_name], tp,
                         flat=folder.from_zero3)
    _optimizer_state(folder)
    return out


def _check_piece(path: str, full: str, state: dict, piece: torch.Size, tp: int,
                 flat: bool) -> None:
    dim = tp_split_dim(full)
    whole = list(piece)
    if dim is not None:
        whole[dim] *= tp
    got = list(_unflatten(state["param"], whole, path).shape if flat else state["param"].shape)
    if full in VOCAB_TENSORS:
        fits = got[1:] == whole[1:] and got[0] <= whole[0]
    else:
        fits = got == whole
    if not fits:
        raise CheckpointError(f"{path} holds a tensor of shape {tuple(got)}; {full} of this "
                              f"model is {tuple(whole)} (its pieces {tuple(piece)} at "
                              f"tensor-parallel size {tp})")
    joined = state.get("cat_dim")
    if tp > 1 and dim is not None and joined is not None and joined != dim:
        raise CheckpointError(f"{path} records its tensor-parallel pieces joined along "
                              f"dimension {joined}, but {full} is cut along dimension {dim}: "
                              "DeepSpeed's engine would cut it wrongly; load it without "
                              "--deepspeed, or convert it with tools/checkpoint/convert.py "
                              "--loader universal")


# --load into the built-in engine ---------------------------------------------------------------


def load_universal_checkpoint(folder: UniversalFolder, model_chunks: Any, optimizer: Any,
                              scheduler: Any, config: Any) -> Any:
    """``--load`` of the universal checkpoint ``folder`` into this rank's model chunks,
    optimizer and scheduler, at this run's tensor/pipeline/data layout: the weights, the
    optimizer state (fp32 main copies, Adam's moments, step; unless --no-load-optim or
    --finetune), the LR schedule, the iteration and consumed samples. Returns
    ``checkpointing.load``'s ``LoadedCheckpoint``. The generators start from --seed (their
    states belong to the source's ranks). Every rank must call it."""
    chunks = as_chunks(model_chunks)
    ckpt, p = config.checkpoint, config.parallel
    load_optim = optimizer is not None and not (ckpt.finetune or ckpt.no_load_optim)

    def build() -> tuple[str, dict, Optional[dict]]:
        check_against_run(folder, config.model)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        placed = stage_chunks(config, pp_rank)
        names = sorted({n for chunk, placement in zip(chunks, placed) for n in chunk_full_names(
            list(unwrap_model(chunk).state_dict()), placement)})
        full = read_universal(folder, optimizer=load_optim, names=names)
        run = config_dict(config)
        cut = LayoutCut(full, p.tensor_model_parallel_size, run,
                        distributed=shards_state(optimizer),
                        mixed=mixed_precision(run), source=f"universal:{folder.path}")
        state, distrib = cut.rank_files(placed, parallel_state.get_tensor_model_parallel_rank(),
                                        p.pipeline_model_parallel_size)
        return folder.path, state, distrib

    return load_built_state(build, chunks, optimizer, scheduler, config, folder.path)


def load_engine_weights(folder: UniversalFolder, module: nn.Module, names: dict[str, str],
                        optimizer: Any, tp: int, tp_rank: int, padded_vocab: int) -> bool:
    """DeepSpeed's engine at ZeRO stage 0 (its optimizer ours, bare), or loading the weights
    only: this rank's pieces of ``folder``'s fp32 weights into ``module`` (``names``: the
    engine's -> our full names) and, when ``optimizer`` (a torch optimizer over the module's
    parameters, grouped as ``get_param_groups`` groups them) is given, its state: Adam's
    moments and step. Returns whether an optimizer state was loaded."""
    full = read_universal(folder, optimizer=optimizer is not None,
                          names=sorted(set(names.values())))

    def piece(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in VOCAB_TENSORS:
            tensor = resize_vocab(tensor, padded_vocab)
        return tp_piece(name, tensor, tp, tp_rank)

    params = list(module.named_parameters())
    with torch.no_grad():
        for engine_name, param in params:
            param.copy_(piece(names[engine_name], full.model[names[engine_name]]))
    if optimizer is None:
        return False
    state = {names[n]: {k: piece(names[n], v)
                        for k, v in full.optimizer["param_state"][names[n]].items()}
             for n, _ in params}
    optimizer.load_state_dict(optim_state.torch_from_named(
        state, full.optimizer["param_groups"], full.optimizer["step"],
        [(names[n], p.shape) for n, p in params]))
    return True


# --load into DeepSpeed's engine -------------------------------------------------------------


def load_into_deepspeed(run: Any, state: Any, folder: UniversalFolder) -> None:
    """``--load`` of the universal checkpoint ``folder`` into ``run`` (``integrations.
    deepspeed.DeepSpeedRun``) at its layout: by DeepSpeed's engine where its config says it
    reads universal checkpoints (``engine_reads_universal``: its optimizer restores the
    fp32 main copies and moments), each parameter read from the folder's name for it; else
    the weights, and at stage 0 our bare optimizer's state, by ``load_engine_weights``.
    Then the iteration, consumed samples and LR schedule into ``state`` and the scheduler;
    the generators start from --seed. Every rank must call it."""
    engine, ck = run.engine, run.cfg.checkpoint
    load_optim = not (ck.finetune or ck.no_load_optim)
    by_engine = engine.load_universal_checkpoint()
    names = engine_names(engine.module, run.pipeline)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    error, dirs, restored = None, None, by_engine and load_optim
    try:
        check_against_run(folder, run.cfg.model)
        if by_engine:
            _check_engine_kind(engine, folder)
        shapes = {n: getattr(p, "ds_shape", p.shape) for n, p in engine.module.named_parameters()}
        dirs = check_engine_files(folder, names, shapes, tp, by_engine)
        if not by_engine:
            restored = load_engine_weights(
                folder, engine.module, names, _bare_optimizer(engine) if load_optim else None,
                tp, parallel_state.get_tensor_model_parallel_rank(),
                run.cfg.model.padded_vocab_size)
            if not restored and hasattr(engine.optimizer, "refresh_fp32_params"):
                engine.optimizer.refresh_fp32_params()  # the main copies follow the weights
    except Exception as exc:  # noqa: BLE001 - raised on every rank, before any collective
        error = exc
    raise_together(error)
    if by_engine:
        _engine_load(engine, folder, dirs)
    reset = _restore_counters(run, state, folder, load_optim, restored)
    how = "by DeepSpeed's engine" if by_engine else "into the engine's model"
    print_rank_0(f" loaded universal checkpoint {folder.path} {how} at iteration "
                 f"{state.iteration} (consumed samples {state.consumed_train_samples}); "
                 f"starting anew: {', '.join(reset)}")


def _check_engine_kind(engine: Any, folder: UniversalFolder) -> None:
    """DeepSpeed's engine (ZeRO 1/2; stage 3 is refused with --deepspeed) reads the universal
    folders converted from ZeRO 0-2 checkpoints only: it looks for their model-state files,
    and ZeRO-3's conversions store each tensor flat."""
    if folder.from_zero3:
        raise CheckpointError(f"{folder.path} was converted from a ZeRO-3 checkpoint, which "
                              f"DeepSpeed's engine at ZeRO stage "
                              f"{engine.zero_optimization_stage()} does not read: load it "
                              "without --deepspeed (the built-in engine reads it), or convert "
                              "it with tools/checkpoint/convert.py --loader universal")


def _restore_counters(run: Any, state: Any, folder: UniversalFolder, load_optim: bool,
                      restored: bool) -> list[str]:
    """The iteration, consumed samples and schedule of ``folder`` into ``state`` and
    ``run``'s scheduler (not under --finetune); returns what starts anew."""
    ck, common = run.cfg.checkpoint, folder.common
    reset = ["random states (this layout's are not in a universal checkpoint)"]
    if ck.finetune:
        return reset + ["iteration, data position, optimizer (--finetune)"]
    state.iteration = int(common.get("iteration", 0))
    state.consumed_train_samples, state.consumed_valid_samples = _consumed(common)
    state.last_saved, state.last_checkpoint = state.iteration, folder.path
    schedule = common.get("opt_param_scheduler")
    if run.scheduler is not None and schedule is not None and load_optim \
            and not ck.no_load_lr_state:
        run.scheduler.load_state_dict(schedule)
    if not restored:
        reset.append("optimizer state" + (" (--no-load-optim)" if ck.no_load_optim else ""))
    return reset


def _bare_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The engine's optimizer where it is ours, bare (ZeRO stage 0 in fp32)."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"--load of a universal checkpoint: DeepSpeed's "
                              f"{type(optimizer).__name__} (ZeRO stage 0) cannot take its "
                              "optimizer state; use --zero-stage 1, or --no-load-optim")
    return optimizer


def _engine_load(engine: Any, folder: UniversalFolder, dirs: dict[str, str]) -> None:
    """DeepSpeed's own universal load, each parameter read from the folder
    ``check_engine_files`` found for it (the folder may name it otherwise than this engine:
    another engine's names, or Megatron-DeepSpeed's)."""
    optimizer = engine.optimizer
    own = optimizer.param_names
    by_param = {p: dirs[n] for n, p in engine.module.named_parameters()}
    optimizer.param_names = {p: by_param.get(p, name) for p, name in own.items()}
    try:
        path, _ = engine.load_checkpoint(os.path.dirname(folder.path),
                                         tag=os.path.basename(folder.path),
                                         load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
    finally:
        optimizer.param_names = own
    if path is None:
        raise CheckpointError(f"--load {folder.load_dir}: DeepSpeed could not load the "
                              f"universal checkpoint {folder.path}")

"""Building this rank's model and putting the weights in, for inference: the one place that
generation (``megatron/text_generation``) and evaluation (``megatron/evaluation``) get a model.

Weights come from a checkpoint of any kind ``--load`` and ``tools/checkpoint/convert.py`` read
(ours and Megatron-LM's in the torch and torch_dist formats, Megatron-DeepSpeed's, saved at any
tensor/pipeline/virtual layout; DeepSpeed's plain engine at ZeRO 0-3 and its pipeline engine:
``megatron.checkpointing.folder.find_checkpoint`` tells them apart), from a local Hugging Face
GPT-2 folder, or from a full state dict in our tensor-parallel-1 naming. A checkpoint of ours
saved at the run's layout is read file by file, as training does; anything else is merged
into one model by that kind's reader in ``megatron.conversion`` and cut for this rank in
memory (no resharded copy on disk). The tokenizer comes from what a checkpoint
recorded (or the copies its converter kept in ``CKPT/tokenizer/``) or from an HF folder's files.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from megatron import checkpointing
from megatron.assembly.build import build_gpt_chunk
from megatron.checkpointing.folder import find_checkpoint, no_checkpoint_error
from megatron.checkpointing.formats.torch.cut import rank_chunk_models
from megatron.checkpointing.full_state import repad_vocab
from megatron.checkpointing.model_shape import check_model_shape
from megatron.checkpointing.ranks import raise_together
from megatron.checkpointing.run_config import stored_run_config, with_layout
from megatron.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
)
from megatron.conversion import ConversionError
from megatron.conversion.full import read_checkpoint
from megatron.conversion.hf import TOKENIZER_DIR, load_hf_checkpoint
from megatron.core import parallel_state
from megatron.model.gpt_model import GPTModel
from megatron.model.hf_gpt2 import model_config_from_hf
from megatron.model.placement import stage_chunks

if TYPE_CHECKING:
    from megatron.checkpointing.folder import CheckpointFolder


class InferenceLoadingError(ValueError):
    """The model cannot be built or loaded; the message names the flag or the file."""


# Configuration -----------------------------------------------------------------------------


def inference_model_config(model: ModelConfig, dtype: Optional[str] = None) -> ModelConfig:
    """The model's shape for inference: no dropout, no recompute, no sequence parallelism,
    no random initialisation; ``dtype`` ("fp32", "bf16", "fp16") replaces the precision."""
    changes: dict[str, Any] = dict(hidden_dropout=0.0, attention_dropout=0.0,
                                   sequence_parallel=False, recompute_granularity=None,
                                   recompute_method=None, perform_initialization=False)
    if dtype is not None:
        changes.update(fp16=dtype == "fp16", bf16=dtype == "bf16")
    return model.replace(**changes)


def _slice_from_dict(cls: type, values: Mapping[str, Any], **changes: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    fields = {k: v for k, v in values.items() if k in names}
    fields.update(changes)
    return cls(**fields)


_TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_name_or_path",
                     "vocab_size")


def checkpoint_folder(load_dir: str) -> CheckpointFolder:
    """``load_dir``'s latest checkpoint of any kind (``checkpointing.folder.find_checkpoint``);
    a folder without one is a ``CheckpointError``."""

    folder = find_checkpoint(load_dir)
    if folder is None:
        raise no_checkpoint_error(load_dir)
    return folder


def saved_checkpoint_layout(load_dir: str) -> tuple[int, int]:
    """(tensor, pipeline) sizes ``load_dir``'s latest checkpoint was saved with."""
    return checkpoint_folder(load_dir).layout()


def launch_layout(saved: tuple[int, int], world_size: int, tp: Optional[int] = None,
                  pp: Optional[int] = None) -> tuple[int, int]:
    """The (tensor, pipeline) sizes to run a checkpoint saved at ``saved`` on ``world_size``
    processes: the flags when given, else the saved layout when it fills the processes, else
    tensor parallelism over all of them."""
    if tp is None and pp is None:
        return saved if saved[0] * saved[1] == world_size else (world_size, 1)
    tp, pp = tp or world_size // (pp or 1), pp or 1
    if tp * pp != world_size:
        raise InferenceLoadingError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
            f"{tp * pp} processes; {world_size} were started")
    return tp, pp


def config_from_checkpoint(load_dir: str, world_size: int = 1, tp: Optional[int] = None,
                           pp: Optional[int] = None) -> RunConfig:
    """The run configuration to run ``load_dir``'s latest checkpoint on ``world_size``
    processes: its model and tokenizer as saved, the layout of ``launch_layout`` (any, not
    only the saved one), one model chunk per stage, one data-parallel replica."""

    folder = checkpoint_folder(load_dir)
    stored, saved = stored_run_config(folder), folder.layout()
    tp, pp = launch_layout(saved, world_size, tp, pp)
    return run_config_from_stored(
        stored, saved, world_size, tp, pp,
        CheckpointConfig(load=load_dir, finetune=True, no_load_optim=True, no_load_rng=True))


def run_config_from_stored(stored: dict, saved: tuple[int, int], world_size: int, tp: int,
                           pp: int, checkpoint: CheckpointConfig) -> RunConfig:
    """A stored run configuration (ours, ``checkpointing.run_config``) of a model saved at
    (tp, pp) ``saved``, to run on ``world_size`` processes at (``tp``, ``pp``): its model
    and tokenizer, one model chunk per stage, one data-parallel replica (so every expert on
    each rank), ``checkpoint``."""
    saved_parallel = dict(stored.get("parallel", {}))
    if (tp, pp) != saved:  # an uneven stage split was chosen for the saved pp
        saved_parallel.pop("decoder_first_pipeline_num_layers", None)
        saved_parallel.pop("decoder_last_pipeline_num_layers", None)
    parallel = _slice_from_dict(ParallelConfig, saved_parallel, world_size=world_size,
                                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=None,
                                virtual_pipeline_model_parallel_size=None,
                                sequence_parallel=False, expert_model_parallel_size=1)
    model = _slice_from_dict(ModelConfig, stored["model"], tensor_model_parallel_size=tp,
                             sequence_parallel=False)
    return RunConfig(model=model, parallel=parallel,
                     data=tokenizer_data_config(stored.get("data", {})), checkpoint=checkpoint)


def hf_model_settings(hf_model_dir: str) -> dict[str, Any]:
    """The model flags (as config field names) of a local HF GPT-2 folder's config.json."""
    from transformers import GPT2Config


    if not os.path.isfile(os.path.join(hf_model_dir, "config.json")):
        raise InferenceLoadingError(f"--hf-model {hf_model_dir!r} has no config.json")
    config = model_config_from_hf(GPT2Config.from_pretrained(hf_model_dir))
    fields = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "seq_length", "max_position_embeddings", "layernorm_epsilon", "activation")
    return {name: getattr(config, name) for name in fields}


def read_hf_model(hf_model_dir: str, make_vocab_size_divisible_by: int = 128):
    """The HF folder as a ``FullCheckpoint`` (tensor parallel 1, one stage)."""

    try:
        return load_hf_checkpoint(hf_model_dir, make_vocab_size_divisible_by, flag="--hf-model")
    except ConversionError as error:
        raise InferenceLoadingError(str(error)) from None


# Tokenizer ---------------------------------------------------------------------------------


def hf_tokenizer_settings(hf_model_dir: str) -> Optional[dict]:
    """``build_tokenizer`` keywords for an HF folder's own tokenizer files, None without any."""
    vocab, merges = (os.path.join(hf_model_dir, n) for n in ("vocab.json", "merges.txt"))
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    if os.path.isfile(os.path.join(hf_model_dir, "tokenizer.json")):
        return dict(tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=hf_model_dir)
    return None


def tokenizer_data_config(data: Mapping[str, Any]) -> DataConfig:
    """A ``DataConfig`` holding the tokenizer fields of a stored ``data`` slice."""
    return DataConfig(**{k: data[k] for k in _TOKENIZER_FIELDS if data.get(k) is not None})


def checkpoint_tokenizer_settings(data: DataConfig, load_dir: Optional[str]) -> dict:
    """``build_tokenizer`` keywords of a checkpoint's recorded tokenizer; a recorded file that
    is gone is looked for in the copies its converter kept (``LOAD/tokenizer/``), so a moved
    checkpoint keeps its tokenizer."""

    settings = {k: getattr(data, k) for k in _TOKENIZER_FIELDS}
    for key in ("vocab_file", "merge_file"):
        path = settings[key]
        if path is None or os.path.isfile(path) or load_dir is None:
            continue
        kept = os.path.join(load_dir, TOKENIZER_DIR, os.path.basename(path))
        if os.path.isfile(kept):
            settings[key] = kept
    return settings


# Building and loading ----------------------------------------------------------------------


def _place() -> tuple[int, int]:
    """(tensor rank, pipeline rank) of this process; (0, 0) without model parallelism."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank())


def _stage_chunks(cfg: RunConfig) -> list:
    """The chunks (one per virtual stage) of this pipeline rank (``megatron.assembly``)."""
    return stage_chunks(cfg, _place()[1])


def load_full_state(chunks: list[nn.Module], cfg: RunConfig,
                    model: Mapping[str, torch.Tensor]) -> None:
    """Cut ``model`` (a full state dict: tensor parallel 1, one stage, our names, any
    vocabulary padding) for this rank's place in ``cfg``'s layout and copy it into
    ``chunks``."""

    m = cfg.model
    states = rank_chunk_models(repad_vocab(dict(model), m.padded_vocab_size), m,
                               cfg.parallel.tensor_model_parallel_size, _place()[0],
                               _stage_chunks(cfg))
    for chunk, state in zip(chunks, states):
        chunk.load_state_dict(state)


def _load_checkpoint(chunks: list[nn.Module], cfg: RunConfig) -> int:
    """The weights of --load's latest checkpoint saved at this layout (no optimizer, schedule
    or generators); returns its iteration. A --load without a checkpoint is an error here."""

    ckpt = dataclasses.replace(cfg.checkpoint, no_load_optim=True, no_load_rng=True,
                               exit_on_missing_checkpoint=True)
    loaded = checkpointing.load_checkpoint(chunks, None, None, cfg.replace(checkpoint=ckpt))
    return loaded.report.iteration if loaded.report is not None else 0


def _saved_at_this_layout(cfg: RunConfig) -> bool:
    """Whether each rank reads its own part of --load's latest checkpoint directly (its
    format's ``loads_at``: ours at this layout, torch_dist at any). A missing checkpoint
    answers True: the native loader names it."""
    folder = find_checkpoint(cfg.checkpoint.load)
    return folder is None or folder.format.loads_at(folder, cfg.parallel)


def _read_full(cfg: RunConfig, hf_model_dir: Optional[str]):
    """The whole model (tp 1, one stage) of the HF folder or of --load's checkpoint, and
    where it came from (for messages)."""

    if hf_model_dir is None:
        load = cfg.checkpoint.load
        full = read_checkpoint(load, verify=not cfg.checkpoint.no_verify_checkpoint,
                               optimizer=False)
        return full, f"--load {load}"
    full = read_hf_model(hf_model_dir, cfg.model.make_vocab_size_divisible_by)
    if full.config["model"]["vocab_size"] != cfg.model.vocab_size:
        raise InferenceLoadingError(
            f"--hf-model {hf_model_dir} has {full.config['model']['vocab_size']} tokens, the "
            f"tokenizer {cfg.model.vocab_size}: give the tokenizer the model was trained with")
    return full, f"--hf-model {hf_model_dir}"


def _load_resharded(chunks: list[nn.Module], cfg: RunConfig,
                    hf_model_dir: Optional[str]) -> int:
    """Read the whole model on every rank and load this rank's part; the ranks agree on
    success before going on (a failed rank would leave the others waiting in a collective).
    Returns the checkpoint's iteration."""

    p = cfg.parallel
    error, iteration = None, 0
    try:
        full, where = _read_full(cfg, hf_model_dir)
        check_model_shape(with_layout(full.config, p.tensor_model_parallel_size,
                                      p.pipeline_model_parallel_size), cfg.model, where)
        try:
            load_full_state(chunks, cfg, full.model)
        except RuntimeError as e:  # load_state_dict: names missing or unexpected
            detail = " ".join(str(e).split())[:400]
            raise InferenceLoadingError(f"{where}: its weights do not fit the model its "
                                        f"configuration describes ({detail})") from None
        iteration = full.iteration
    except Exception as e:  # noqa: BLE001 - decided together below, raised as it was
        error = e
    raise_together(error)
    return iteration


def load_inference_weights(chunks: list[nn.Module], cfg: RunConfig,
                           hf_model_dir: Optional[str] = None) -> int:
    """Fill this rank's ``chunks`` from ``hf_model_dir`` or ``cfg.checkpoint.load`` and put
    them in eval mode; returns the checkpoint's iteration (0 for HF).

    Every rank must call it (loading is collective). At the layout the checkpoint was saved
    with each rank reads its own file; otherwise, and for ``hf_model_dir``, every rank reads
    the whole model (``megatron.conversion``) and keeps its part, which costs one full copy
    of the weights in each process's memory while loading.
    """
    if hf_model_dir is None and cfg.checkpoint.load is None:
        raise InferenceLoadingError("nothing to load: give --load CHECKPOINT_DIR or "
                                    "--hf-model HF_GPT2_DIR")
    if hf_model_dir is None and _saved_at_this_layout(cfg):
        iteration = _load_checkpoint(chunks, cfg)  # each rank reads its own file
    else:
        iteration = _load_resharded(chunks, cfg, hf_model_dir)
    for chunk in chunks:
        chunk.eval()
    return iteration


def build_inference_model(config: RunConfig, *, device: torch.device,
                          full_state_dict: Optional[Mapping[str, torch.Tensor]] = None,
                          hf_model_dir: Optional[str] = None,
                          dtype: Optional[str] = None) -> GPTModel:
    """This rank's stage (one chunk) of the model in eval mode, its weights loaded from
    ``full_state_dict`` (unsharded, our names) when given, else from ``hf_model_dir`` or the
    checkpoint ``config.checkpoint.load`` at any saved layout. Every rank calls it."""
    chunk = stage_chunks(config, _place()[1], interleaved=False)[0]
    model = build_gpt_chunk(inference_model_config(config.model, dtype), chunk, device)
    if full_state_dict is not None:
        load_full_state([model], config, full_state_dict)
        return model.eval()
    load_inference_weights([model], config, hf_model_dir)
    return model

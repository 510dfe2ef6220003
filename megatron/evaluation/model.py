"""Build this rank's model and load the weights to evaluate: one function for every source.

``build_model_for_evaluation`` makes the model chunks of this rank's (tensor, pipeline,
virtual) place and fills them from ``--load`` (our checkpoint, or a Megatron-DeepSpeed one, saved
at any layout) or from a local Hugging Face GPT-2 folder. A checkpoint saved at the run's
layout is loaded file by file, as training does; any other source is merged into one model
and cut for this rank in memory by ``megatron.conversion`` (no resharded copy on disk).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch
from torch import nn

from megatron.config import RunConfig
from megatron.model.gpt_model import GPTModel


class EvaluationModelError(ValueError):
    """The model to evaluate cannot be built or loaded; the message names the flag."""


def hf_model_settings(hf_model_dir: str) -> dict[str, Any]:
    """The model flags (as config field names) of a local HF GPT-2 folder's config.json, for
    parsing the command line with them as defaults."""
    from transformers import GPT2Config

    from megatron.model.hf_gpt2 import model_config_from_hf

    if not os.path.isfile(os.path.join(hf_model_dir, "config.json")):
        raise EvaluationModelError(f"--hf-model {hf_model_dir!r} has no config.json")
    config = model_config_from_hf(GPT2Config.from_pretrained(hf_model_dir))
    fields = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "seq_length", "max_position_embeddings", "layernorm_epsilon", "activation")
    return {name: getattr(config, name) for name in fields}


def _model_chunks(cfg: RunConfig, device: torch.device) -> list[nn.Module]:
    from megatron.training import RunContext, build_model_chunks

    def provider(ctx, pre_process, post_process, first_layer, num_layers):
        return GPTModel(ctx.config.model, pre_process=pre_process, post_process=post_process,
                        first_layer=first_layer, num_layers=num_layers, device=device)

    return build_model_chunks(provider, RunContext(cfg, device=device))


def _load_checkpoint(chunks: list[nn.Module], cfg: RunConfig) -> int:
    """The weights of --load's latest checkpoint (no optimizer, schedule or generators);
    returns its iteration. A --load without a checkpoint is an error here."""
    from megatron import checkpointing

    ckpt = dataclasses.replace(cfg.checkpoint, no_load_optim=True, no_load_rng=True,
                               exit_on_missing_checkpoint=True)
    loaded = checkpointing.load_checkpoint(chunks, None, None, cfg.replace(checkpoint=ckpt))
    return loaded.report.iteration if loaded.report is not None else 0


def _saved_at_this_layout(cfg: RunConfig) -> bool:
    """Whether --load's latest checkpoint has this run's tensor/pipeline/virtual layout (so
    each rank reads its own file). A missing checkpoint answers True: the native loader
    names it."""
    from megatron.checkpointing import read_manifest, read_tracker
    from megatron.checkpointing.paths import resolve_iteration_dir, saved_layout

    load, p = cfg.checkpoint.load, cfg.parallel
    tracker = read_tracker(load) if os.path.isdir(load) else None
    if tracker is None:
        return True
    iter_dir = resolve_iteration_dir(load, tracker)
    if saved_layout(iter_dir) != (p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
        return False
    manifest = read_manifest(iter_dir) or {}
    chunks = (manifest.get("parallel_layout") or {}).get("num_model_chunks", 1)
    saved = ((manifest.get("config") or {}).get("parallel") or {})
    return chunks == (p.virtual_pipeline_model_parallel_size or 1) and all(
        saved.get(k) == getattr(p, k) for k in ("decoder_first_pipeline_num_layers",
                                                "decoder_last_pipeline_num_layers"))


def _read_full(cfg: RunConfig, hf_model_dir: Optional[str]):
    """The whole model (tp 1, one stage) of the HF folder or of --load's checkpoint, and
    where it came from (for messages)."""
    from megatron.conversion import ConversionError, load_full_checkpoint
    from megatron.conversion.hf import load_hf_checkpoint

    if hf_model_dir is None:
        load = cfg.checkpoint.load
        full = load_full_checkpoint(load, verify=not cfg.checkpoint.no_verify_checkpoint,
                                    optimizer=False)
        return full, f"--load {load}"
    try:
        full = load_hf_checkpoint(hf_model_dir, cfg.model.make_vocab_size_divisible_by,
                                  flag="--hf-model")
    except ConversionError as error:
        raise EvaluationModelError(str(error)) from None
    if full.config["model"]["vocab_size"] != cfg.model.vocab_size:
        raise EvaluationModelError(
            f"--hf-model {hf_model_dir} has {full.config['model']['vocab_size']} tokens, the "
            f"tokenizer {cfg.model.vocab_size}: give the tokenizer the model was trained with")
    return full, f"--hf-model {hf_model_dir}"


def _load_full(chunks: list[nn.Module], cfg: RunConfig, full: Any, where: str) -> None:
    """Cut ``full`` (a ``FullCheckpoint``) for this rank's place in the run's layout and
    copy it into ``chunks``."""
    from megatron.checkpointing.model_shape import check_model_shape
    from megatron.conversion.full import rank_chunk_models, repad_vocab, with_layout
    from megatron.conversion.sharding import pipeline_chunks
    from megatron.core import parallel_state

    p, m = cfg.parallel, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    check_model_shape(with_layout(full.config, tp, pp), m, where)
    stage = pipeline_chunks(m.num_layers, pp, p.virtual_pipeline_model_parallel_size,
                            p.decoder_first_pipeline_num_layers,
                            p.decoder_last_pipeline_num_layers)[
        parallel_state.get_pipeline_model_parallel_rank()]
    states = rank_chunk_models(repad_vocab(full.model, m.padded_vocab_size),
                               not m.untie_embeddings_and_output_weights, tp,
                               parallel_state.get_tensor_model_parallel_rank(), stage)
    for chunk, state in zip(chunks, states):
        chunk.load_state_dict(state)


def _load_resharded(chunks: list[nn.Module], cfg: RunConfig,
                    hf_model_dir: Optional[str]) -> int:
    """Read the whole model on every rank and load this rank's part; the ranks agree on
    success before going on (a failed rank would leave the others waiting in a collective).
    Returns the checkpoint's iteration."""
    from megatron.checkpointing import CheckpointError
    from megatron.checkpointing.ranks import all_true

    error, iteration = None, 0
    try:
        full, where = _read_full(cfg, hf_model_dir)
        _load_full(chunks, cfg, full, where)
        iteration = full.iteration
    except Exception as e:  # noqa: BLE001 - decided together below, raised as it was
        error = e
    if not all_true(error is None):
        if error is not None:
            raise error
        raise CheckpointError("loading the model failed on another rank (see its error)")
    return iteration


def build_model_for_evaluation(cfg: RunConfig, device: torch.device,
                               hf_model_dir: Optional[str] = None) -> tuple[list[nn.Module], int]:
    """This rank's model chunks in eval mode, loaded from ``hf_model_dir`` or from
    ``cfg.checkpoint.load``; returns them and the checkpoint's iteration (0 for HF).

    Every rank must call it (loading is collective). ``cfg`` must hold the tokenizer's
    vocabulary size (``with_vocab_size``). Any layout loads any checkpoint: at the layout it
    was saved with each rank reads its own file; otherwise, and for ``hf_model_dir``, every
    rank reads the whole model (``megatron.conversion``) and keeps its part, which costs one
    full copy of the weights in each process's memory while loading.
    """
    if hf_model_dir is None and cfg.checkpoint.load is None:
        raise EvaluationModelError("nothing to evaluate: give --load CHECKPOINT_DIR or "
                                   "--hf-model HF_GPT2_DIR")
    chunks = _model_chunks(cfg, device)
    if hf_model_dir is None and _saved_at_this_layout(cfg):
        iteration = _load_checkpoint(chunks, cfg)  # each rank reads its own file
    else:
        iteration = _load_resharded(chunks, cfg, hf_model_dir)
    for chunk in chunks:
        chunk.eval()
    return chunks, iteration

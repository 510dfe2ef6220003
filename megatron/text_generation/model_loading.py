"""Building this rank's stage of a GPT for generation and putting the weights in: the one
place where generation gets a model.

Weights come from a checkpoint of ours saved at the layout this run has (each rank reads its
own ``mp_rank_*`` file, as Megatron's tools do under ``torchrun --nproc_per_node tp*pp``), or
from a full, unsharded state dict in our tensor-parallel-1 naming (a converted Hugging Face
GPT-2, or any checkpoint read whole), which is cut here into this rank's shard.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Optional

import torch

from megatron.checkpointing import (
    CheckpointError,
    load_checkpoint,
    load_checkpoint_config,
    read_tracker,
)
from megatron.checkpointing.paths import resolve_iteration_dir, saved_layout
from megatron.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    layer_range,
)
from megatron.core import parallel_state
from megatron.model.gpt_model import GPTModel

_LAYER_KEY = re.compile(r"encoder\.layers\.(\d+)\.(.*)")
_VOCAB_KEYS = ("word_embeddings.weight", "output_layer.weight")


def inference_model_config(model: ModelConfig, dtype: Optional[str] = None) -> ModelConfig:
    """The model's shape for generation: no dropout, no recompute, no sequence parallelism,
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


def config_from_checkpoint(load_dir: str, world_size: int = 1) -> RunConfig:
    """The run configuration to generate from ``load_dir``'s latest checkpoint: its model and
    tokenizer as saved, its tensor/pipeline layout, one data-parallel replica."""
    stored = load_checkpoint_config(load_dir)
    if stored is None:
        raise CheckpointError(f"--load {load_dir} holds no checkpoint "
                              "(no latest_checkpointed_iteration.txt)")
    if not isinstance(stored.get("model"), dict):
        raise CheckpointError(f"--load {load_dir}: the checkpoint stores no configuration of "
                              "ours (saved by Megatron-LM?); convert it first")
    tp, pp = saved_layout(resolve_iteration_dir(load_dir, read_tracker(load_dir)))
    if tp * pp != world_size:
        raise CheckpointError(
            f"--load {load_dir} was saved at tensor-parallel size {tp} x pipeline-parallel "
            f"size {pp}: run generation on {tp * pp} processes (torchrun --nproc_per_node "
            f"{tp * pp}), not {world_size}")
    saved_parallel = stored.get("parallel", {})
    if saved_parallel.get("virtual_pipeline_model_parallel_size"):
        raise CheckpointError(f"--load {load_dir} was saved with a virtual pipeline: "
                              "generation runs one chunk per stage; convert it first")
    parallel = _slice_from_dict(ParallelConfig, saved_parallel, world_size=world_size,
                                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                sequence_parallel=False)
    data = stored.get("data", {})
    tokenizer = {k: data[k] for k in _TOKENIZER_FIELDS if k in data}
    return RunConfig(
        model=_slice_from_dict(ModelConfig, stored["model"]), parallel=parallel,
        data=DataConfig(**tokenizer),
        checkpoint=CheckpointConfig(load=load_dir, finetune=True, no_load_optim=True,
                                    no_load_rng=True))


def _stage() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def build_inference_model(config: RunConfig, *, device: torch.device,
                          full_state_dict: Optional[Mapping[str, torch.Tensor]] = None,
                          dtype: Optional[str] = None) -> GPTModel:
    """This rank's stage of the model in eval mode, its weights loaded: from
    ``full_state_dict`` (unsharded, our names) when given, else from the checkpoint
    ``config.checkpoint.load`` (saved at this run's layout). Every rank calls it."""
    pp_rank, pp_size = _stage()
    model_config = inference_model_config(config.model, dtype)
    first, count = layer_range(config.pipeline_stage_num_layers, pp_rank)
    model = GPTModel(model_config, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1,
                     first_layer=first, num_layers=count, device=device)
    if full_state_dict is not None:
        model.load_state_dict(shard_state_dict(full_state_dict, model, first))
    elif config.checkpoint.load is not None:
        ckpt = config.checkpoint.replace(finetune=True, no_load_optim=True, no_load_rng=True)
        load_checkpoint(model, None, None, config.replace(checkpoint=ckpt))
    else:
        raise ValueError("build_inference_model needs a checkpoint (--load) or a state dict")
    return model.eval()


def shard_state_dict(full: Mapping[str, torch.Tensor], model: GPTModel,
                     first_layer: int) -> dict[str, torch.Tensor]:
    """``model``'s state dict cut from ``full`` (tensor parallel 1, one stage, layers
    numbered globally): its layers renumbered from ``first_layer``, the last stage's copy of
    the tied embedding taken from the first stage's, each tensor-parallel weight split as the
    model splits it, vocabulary rows padded with zeros or trimmed to the model's padding."""
    tp_rank = (parallel_state.get_tensor_model_parallel_rank()
               if parallel_state.model_parallel_is_initialized() else 0)
    params = dict(model.named_parameters())
    out = {}
    for key, target in model.state_dict().items():
        tensor = full[_full_key(key, first_layer)]
        param = params.get(key)
        if key.endswith(_VOCAB_KEYS):
            tensor = _pad_rows(tensor, model.config.padded_vocab_size)
        if param is not None and getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            tensor = tensor.chunk(tensor.size(dim) // target.size(dim), dim=dim)[tp_rank]
        if tensor.shape != target.shape:
            raise ValueError(f"{key}: the full state dict's tensor has shape "
                             f"{tuple(tensor.shape)} for this rank, the model {tuple(target.shape)}")
        out[key] = tensor
    return out


def _full_key(key: str, first_layer: int) -> str:
    match = _LAYER_KEY.fullmatch(key)
    if match:
        return f"encoder.layers.{first_layer + int(match.group(1))}.{match.group(2)}"
    if key == "word_embeddings.weight":  # the last stage's copy of the tied embedding
        return "embedding.word_embeddings.weight"
    return key


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.size(0) >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])

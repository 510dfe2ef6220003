"""What the generation tools share: their model and tokenizer flags, and one call that joins
the process group, builds this rank's stage with its weights and the tokenizer.

A checkpoint (``--load``: any kind ``megatron.checkpointing.folder.find_checkpoint`` tells
apart, saved at any layout) and a Hugging Face GPT-2 folder
(``--hf-model``, converted in memory) both run at any ``--tensor-model-parallel-size`` x
``--pipeline-model-parallel-size`` (``torchrun --nproc_per_node tp*pp``; one process works);
a checkpoint launched without the flags runs at its saved layout when the process count
matches it. Loading is ``megatron.inference.loading``'s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.assembly.initialize import initialize_distributed
from megatron.checkpointing import CheckpointError
from megatron.config import ParallelConfig, RunConfig
from megatron.core import parallel_state
from megatron.inference.loading import (
    InferenceLoadingError,
    build_inference_model,
    checkpoint_tokenizer_settings,
    config_from_checkpoint,
    hf_tokenizer_settings,
    launch_layout,
    read_hf_model,
)
from megatron.platform.device import compute_device, resolve_backend
from megatron.platform.launch_env import distributed_env
from megatron.platform.output import global_rank
from megatron.tokenizer import build_tokenizer


class SetupError(Exception):
    """A flag or file the generation tools cannot use; the message names it."""


@dataclass
class GenerationModel:
    """This rank's stage, the tokenizer, the device, and the configuration they came from."""

    model: Any
    tokenizer: Any
    device: torch.device
    config: RunConfig

    @property
    def context(self) -> int:
        """Most positions a sequence (prompt and new tokens) may have."""
        return self.config.model.max_position_embeddings


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--load / --hf-model, the tokenizer flags (Megatron's spellings), precision, device."""
    src = parser.add_argument_group("model")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument("--load", help="a checkpoint folder of any kind --load reads (ours, "
                     "Megatron-DeepSpeed's, DeepSpeed's plain engine at ZeRO 0-3 or pipeline "
                     "engine), saved at any tensor/pipeline layout")
    one.add_argument("--hf-model", help="a local Hugging Face GPT-2 folder (config.json and "
                     "weights), converted in memory")
    src.add_argument("--tensor-model-parallel-size", type=int, default=None,
                     help="tensor-parallel size (default: the checkpoint's when the process "
                     "count matches it, else all processes)")
    src.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                     help="pipeline-parallel size (default: the checkpoint's, or 1)")
    src.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                     help="auto: the checkpoint's own on a GPU, fp32 on the CPU")
    src.add_argument("--use-cpu", action="store_true", help="compute on the CPU even where a "
                     "GPU is")
    tok = parser.add_argument_group("tokenizer (default: what the checkpoint recorded, or the "
                                    "--hf-model folder's files)")
    tok.add_argument("--tokenizer-type", default=None,
                     help="GPT2BPETokenizer, PretrainedFromHF or NullTokenizer")
    tok.add_argument("--vocab-file", default=None)
    tok.add_argument("--merge-file", default=None)
    tok.add_argument("--tokenizer-name-or-path", default=None)
    tok.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's size")


def _hf_config_and_weights(folder: str, tp: Optional[int], pp: Optional[int],
                          world_size: int):
    tp, pp = launch_layout((1, 1), world_size, tp, pp)
    full = read_hf_model(folder)
    config = RunConfig(model=full.model_config(tp), parallel=ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=world_size))
    return config, full.model


def _config_and_weights(args: argparse.Namespace, world_size: int):
    """The run configuration at the launch layout, and the full weights of --hf-model (None
    for --load: every rank reads its part of the checkpoint once the group is up)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.load is not None:
        return config_from_checkpoint(args.load, world_size, tp, pp), None
    return _hf_config_and_weights(args.hf_model, tp, pp, world_size)


def _tokenizer_settings(args: argparse.Namespace, config: RunConfig) -> dict:
    if args.tokenizer_type is not None:
        return dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                    merge_file=args.merge_file,
                    tokenizer_name_or_path=args.tokenizer_name_or_path,
                    vocab_size=args.vocab_size)
    if args.hf_model is None:
        return checkpoint_tokenizer_settings(config.data, args.load)
    settings = hf_tokenizer_settings(args.hf_model)
    if settings is None:
        raise SetupError(f"--hf-model {args.hf_model} holds no tokenizer (vocab.json and "
                         "merges.txt, or tokenizer.json): pass --tokenizer-type and its files")
    return settings


def build_generation_tokenizer(args: argparse.Namespace, config: RunConfig):
    """The tokenizer from the flags, else the checkpoint's record or the HF folder's files;
    checked to fit the model's vocabulary."""
    settings = _tokenizer_settings(args, config)
    try:
        tokenizer = build_tokenizer(**settings)
    except (ValueError, OSError) as e:
        source = "flags" if args.tokenizer_type else "checkpoint's recorded tokenizer"
        raise SetupError(f"cannot build the tokenizer from the {source} ({e}); pass "
                         "--tokenizer-type and its files") from e
    if tokenizer.vocab_size > config.model.padded_vocab_size:
        raise SetupError(f"the tokenizer has {tokenizer.vocab_size} ids, the model's "
                         f"vocabulary {config.model.vocab_size}: not the model's tokenizer")
    return tokenizer


def _precision(choice: str, device: torch.device) -> Optional[str]:
    if choice != "auto":
        return choice
    return None if device.type == "cuda" else "fp32"


# How long a collective of generation waits for the other ranks (every group, the default one
# included) before it fails instead of hanging.
TIMEOUT_MINUTES = 10


def setup_generation(args: argparse.Namespace) -> GenerationModel:
    """Check the inputs, join the process group, build this rank's model and the tokenizer."""
    env = distributed_env()
    try:
        config, full = _config_and_weights(args, env["world_size"])
    except Exception as e:  # noqa: BLE001 - CheckpointError, InferenceLoadingError, ConfigError
        raise SetupError(str(e)) from e
    tokenizer = build_generation_tokenizer(args, config)
    # Generation runs on a GPU or the CPU, also where PJRT_DEVICE is set (XLA is training's).
    device = compute_device(args.use_cpu, env["local_rank"], xla_allowed=False)
    initialize_distributed(resolve_backend("auto", args.use_cpu, xla_allowed=False),
                           TIMEOUT_MINUTES, device)
    parallel_state.set_default_device(device)
    p = config.parallel
    parallel_state.initialize_model_parallel(p.tensor_model_parallel_size,
                                             p.pipeline_model_parallel_size,
                                             distributed_timeout_minutes=TIMEOUT_MINUTES)
    try:
        model = build_inference_model(config, device=device, full_state_dict=full,
                                      dtype=_precision(args.precision, device))
    except (CheckpointError, InferenceLoadingError) as e:
        raise SetupError(str(e)) from e
    return GenerationModel(model, tokenizer, device, config)


def is_rank_0() -> bool:
    """Global rank 0, also before the process group is up (from the launcher's RANK)."""
    return global_rank() == 0


def broadcast_object(obj: Any) -> Any:
    """Global rank 0's ``obj`` on every rank (a request, a prompt, a stop signal)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

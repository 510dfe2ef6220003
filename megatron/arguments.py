"""Megatron-compatible command line -> one validated, typed ``RunConfig``.

Flags keep Megatron(-DeepSpeed) spellings and defaults. Each flag's ``dest`` is the name of a
config field, so the parsed namespace is poured into the config dataclasses by field name
(as Megatron-LM's ``argument_utils`` does); old aliases and derived values are resolved on the
namespace first. Every check runs here, before any process group exists, and fails with a
``ConfigError`` whose message names the flags and numbers involved.

    config = parse_args()                        # sys.argv; world size from WORLD_SIZE
    config = parse_args(argv, world_size=64)     # explicit
    print_config(config)                         # Megatron's "arguments" block
    config = config.with_vocab_size(tokenizer.vocab_size)   # once the tokenizer is built

Bad input, including an unknown flag or a malformed value, raises ``ConfigError`` (argparse's
own exit is turned into the exception) so callers and tests can catch it; entry scripts call
``parse_args_or_exit``, which prints ``error: ...`` to stderr and exits with status 2 as
argparse would.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch

from megatron.config import (
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    flag,
)
from megatron.run_config import (
    CheckpointConfig,
    DataConfig,
    DeepSpeedConfig,
    LoggingConfig,
    RunConfig,
    TrainingConfig,
    canonical_tokenizer_type,
)
from megatron.timers import TIMING_LOG_OPTIONS

logger = logging.getLogger(__name__)

ExtraArgsProvider = Callable[[argparse.ArgumentParser], Optional[argparse.ArgumentParser]]

# Flags accepted so that existing Megatron scripts run unchanged, but with no effect here.
NO_OP_FLAGS = {
    "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "bias_gelu_fusion": "--no-bias-gelu-fusion",
    "bias_dropout_fusion": "--no-bias-dropout-fusion",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
    "async_tensor_model_parallel_allreduce": "--no-async-tensor-model-parallel-allreduce",
    "apply_query_key_layer_scaling": "--no-query-key-layer-scaling",
    "fp32_residual_connection": "--fp32-residual-connection",
    "use_mcore_models": "--use-mcore-models",
    "persist_layer_norm": "--no-persist-layer-norm",
    "scatter_gather_tensors_in_pipeline": "--no-scatter-gather-tensors-in-pipeline",
    "use_contiguous_buffers_in_local_ddp": "--use-contiguous-buffers-in-local-ddp",
    "overlap_param_gather": "--overlap-param-gather",
    "overlap_p2p_comm": "--overlap-p2p-comm",
    "log_memory_to_tensorboard": "--log-memory-to-tensorboard",
    "local_rank": "--local_rank",
}
# Flags translated into other fields before the configs are built.
TRANSLATED_FLAGS = (
    "checkpoint_activations",
    "recompute_activations",
    "distribute_checkpointed_activations",
    "num_layers_per_virtual_pipeline_stage",
    "openai_gelu",
    "num_experts",
)
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")

_SLICE_CLASSES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "deepspeed": DeepSpeedConfig,
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


# ----------------------------------------------------------------------------- flag groups


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="Transformer layers (required).")
    g.add_argument("--hidden-size", type=int, default=None, help="Hidden size (required).")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 x hidden).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Heads (required).")
    g.add_argument("--kv-channels", type=int, default=None, help="Per-head size (default hidden/heads).")
    g.add_argument("--seq-length", type=int, default=None, help="Tokens per sample (required).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Position table size (default --seq-length).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="No biases in the linear layers.")
    g.add_argument("--openai-gelu", "--gelu-tanh", action="store_true", dest="openai_gelu",
                   help="GeLU with the tanh approximation (OpenAI's GPT-2 code).")
    g.add_argument("--use-flash-attn", "--use-flash-attn-v2", action="store_true",
                   dest="use_flash_attn", help="Use flash-attn where installed.")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=True,
                   help="Softmax in fp32 (always on here; Megatron forces it under fp16 with "
                   "query-key layer scaling, its default).")


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, nargs="+", default=None,
                   help="Only 1 (a dense MLP), as Megatron-DeepSpeed's dense GPT scripts pass.")


def _add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale; dynamic scaling when not given.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="fp32 gradient accumulation and all-reduce (always on with --bf16).")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism and distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Interleaved 1F1B: layers per model chunk (needs pipeline size > 2).")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Uneven split: layers on the first pipeline stage.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Uneven split: layers on the last pipeline stage.")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Shard layernorm/dropout activations over tensor parallel (off at tp 1).")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Gradient elements per all-reduce bucket (default: one per buffer).")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default="auto",
                   help="Default: nccl on a GPU, gloo on the CPU (the backend follows the "
                   "device; see --use-cpu).")
    g.add_argument("--use-cpu", action="store_true",
                   help="Train on the CPU (gloo) even where a GPU is visible; by default each "
                   "process uses the GPU of its LOCAL_RANK whenever CUDA is available.")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic kernels only (torch.use_deterministic_algorithms; "
                   "CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set): the same run gives the same "
                   "bits on a GPU, slower. CPU kernels are deterministic already.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout of collectives (NCCL and gloo) before a hung rank fails.")
    g.add_argument("--use-cpu-initialization", action="store_true")


def _add_recompute_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation recomputation")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", "--activations-checkpoint-method",
                   choices=["uniform", "block"], default=None, dest="recompute_method")
    g.add_argument("--recompute-num-layers", "--checkpoint-num-layers",
                   "--activations-checkpoint-num-layers", type=int, default=1,
                   dest="recompute_num_layers")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Old spelling of --recompute-granularity full --recompute-method uniform.")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM spelling of --recompute-granularity selective.")
    g.add_argument("--distribute-checkpointed-activations", "--distribute-saved-activations",
                   action="store_true", dest="distribute_checkpointed_activations",
                   help="Accepted with full recomputation; no effect here.")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="Required.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default: micro-batch size x data-parallel size.")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Grow the global batch from START by INCREMENT over SAMPLES samples.")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--train-tokens", type=int, default=None,
                   help="Also stop once this many tokens (samples x --seq-length) are consumed.")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="1: empty the CUDA allocator's cache after each step and evaluation; "
                        "2: also before the optimizer step.")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's garbage collector off; collect at set iterations.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: collect every N iterations (0: only at evaluation).")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="With --manual-gc: do not collect around evaluations.")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"],
                   default="constant")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)


def _add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-decay-tokens", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-tokens", type=int, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler",
                   action="store_true", dest="override_opt_param_scheduler",
                   help="Take the schedule from these flags, not from the checkpoint.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="Take the schedule from the checkpoint, not from these flags.")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="One dataset prefix, or WEIGHT PREFIX pairs to blend.")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true", help="Synthetic tokens (wins over paths).")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions.")
    g.add_argument("--data-impl", choices=["mmap", "infer"], default="mmap")
    g.add_argument("--mmap-warmup", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                   help="GPT2BPETokenizer, PretrainedFromHF (alias HFTokenizer, "
                   "HuggingFaceTokenizer) or NullTokenizer.")
    g.add_argument("--vocab-file", "--vocab", default=None, dest="vocab_file")
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-name-or-path", "--tokenizer-model", default=None,
                   dest="tokenizer_name_or_path")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary.")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-load-lr-state", action="store_true",
                   help="Load the optimizer but not the learning-rate scheduler's state "
                        "(Megatron-DeepSpeed): the schedule starts again from these flags.")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None)
    g.add_argument("--save-best", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="Stop with an error when --load holds no checkpoint.")
    g.add_argument("--ckpt-format", default="torch", help="Only torch (Megatron's layout).")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--timing-log-option", choices=TIMING_LOG_OPTIONS, default="minmax",
                   help="How timers are reported across ranks.")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-bubble", action="store_true", help="Log pipeline bubble time.")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-all-ranks", action="store_true",
                   help="Print messages on every rank, each line prefixed by [rank N] (default: "
                        "once, from global rank 0; a warning only another rank meets then "
                        "shows only with this flag).")
    g.add_argument("--wandb-project", default=None, help="Accepted; not used.")


def _add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DeepSpeed")
    g.add_argument("--deepspeed", action="store_true", help="Train with DeepSpeed's engine.")
    g.add_argument("--deepspeed_config", "--deepspeed-config", default=None,
                   dest="deepspeed_config", help="DeepSpeed JSON config.")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None)
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="DeepSpeed engine without its pipeline module.")


def _add_no_op_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "compatibility", "Accepted so Megatron scripts run unchanged; they have no effect here "
        "(fused kernels are optional accelerators chosen automatically; gradient buffers are "
        "always contiguous; pipeline exchanges and the distributed optimizer's parameter "
        "gather are not overlapped with compute; memory is always logged to TensorBoard; "
        "LOCAL_RANK from the launcher's environment is authoritative).")
    for dest, spelling in NO_OP_FLAGS.items():
        if dest == "local_rank":
            g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest=dest)
        elif spelling.startswith("--no-"):
            g.add_argument(spelling, action="store_false", dest=dest)
        else:
            g.add_argument(spelling, action="store_true", dest=dest)


_GROUPS = (
    _add_model_args, _add_moe_args, _add_precision_args, _add_parallel_args,
    _add_recompute_args, _add_training_args, _add_optimizer_args, _add_scheduler_args,
    _add_data_args, _add_checkpoint_args, _add_logging_args, _add_deepspeed_args,
    _add_no_op_args,
)


def build_parser() -> argparse.ArgumentParser:
    """The full Megatron-compatible parser (without any extra provider's flags)."""
    parser = _Parser(description="Megatron-compatible GPT pre-training", allow_abbrev=False)
    for add_group in _GROUPS:
        add_group(parser)
    return parser


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest != argparse.SUPPRESS and a.dest != "help"}


# ----------------------------------------------------------------------------- parsing


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[ExtraArgsProvider] = None,
    world_size: Optional[int] = None,
    *,
    defaults: Optional[Mapping[str, Any]] = None,
    require_training: bool = True,
) -> RunConfig:
    """Parse Megatron flags into a validated RunConfig. Raises ConfigError on bad input.

    argv: the flags (default ``sys.argv[1:]``). extra_args_provider: Megatron's hook,
    ``provider(parser) -> parser``, adding flags whose values land in ``config.extra``; it may
    also ``parser.set_defaults(train_iters=..., mock_data=True)`` to satisfy requirements.
    world_size: default the WORLD_SIZE environment variable, else 1. defaults: field -> value
    used when the flag is not given (Megatron's ``defaults``). require_training=False drops the
    requirements that only training has (a schedule length, a data source, tokenizer files).
    """
    parser = build_parser()
    own = _dests(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    extra_dests = _dests(parser) - own
    if defaults:
        _apply_defaults(parser, defaults)
    ns, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if unknown:
        raise ConfigError(_unknown_flags_message(parser, unknown))
    world_size = _resolve_world_size(world_size)
    _check_required(ns, require_training)
    _check_flags(ns)
    _translate(ns, world_size)
    return _build_run_config(ns, extra_dests)


def parse_args_or_exit(*args: Any, **kwargs: Any) -> RunConfig:
    """``parse_args`` for entry scripts: on bad input print ``error: ...`` and exit with 2."""
    try:
        return parse_args(*args, **kwargs)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _apply_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    unknown = sorted(set(defaults) - _dests(parser))
    if unknown:
        raise ConfigError(f"defaults name no flag: {', '.join(unknown)}")
    parser.set_defaults(**defaults)


def _unknown_flags_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    if not flags:
        return f"unexpected positional arguments: {' '.join(unknown)}"
    known = list(parser._option_string_actions)
    hints = []
    for name in flags:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return f"unrecognized arguments: {', '.join(hints)}"


def _resolve_world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        # torchrun and the deepspeed launcher set WORLD_SIZE; srun sets SLURM_NTASKS.
        name = "WORLD_SIZE" if "WORLD_SIZE" in os.environ or "SLURM_NTASKS" not in os.environ \
            else "SLURM_NTASKS"
        raw = os.environ.get(name, "1")
        try:
            world_size = int(raw)
        except ValueError:
            raise ConfigError(f"{name} environment variable is not an integer: {raw!r}") from None
    if world_size < 1:
        raise ConfigError(f"world size must be positive, got {world_size}")
    return world_size


def _check_required(ns: argparse.Namespace, require_training: bool) -> None:
    missing = [flag(name) for name in _REQUIRED if getattr(ns, name) is None]
    if require_training:
        if ns.train_iters is None and ns.train_samples is None:
            missing.append("--train-iters or --train-samples")
        if not (ns.mock_data or ns.data_path or ns.train_data_path or ns.valid_data_path
                or ns.test_data_path):
            missing.append("a data source (--data-path, --train-data-path/--valid-data-path/"
                           "--test-data-path, or --mock-data)")
        gpt2_without_files = (canonical_tokenizer_type(ns.tokenizer_type) == "GPT2BPETokenizer"
                              and ns.vocab_file is None and ns.merge_file is None)
        if not (ns.mock_data and gpt2_without_files):
            # Mock data needs no tokenizer: the model then uses GPT-2's vocabulary size.
            missing += _missing_tokenizer_inputs(ns)
    if missing:
        raise ConfigError("missing required flags: " + "; ".join(missing))


def _missing_tokenizer_inputs(ns: argparse.Namespace) -> list[str]:
    kind = canonical_tokenizer_type(ns.tokenizer_type)
    needs = {
        "GPT2BPETokenizer": ("vocab_file", "merge_file"),
        "PretrainedFromHF": ("tokenizer_name_or_path",),
        "NullTokenizer": ("vocab_size",),
    }[kind]
    return [f"{flag(n)} (for --tokenizer-type {ns.tokenizer_type})"
            for n in needs if getattr(ns, n) is None]


def _check_flags(ns: argparse.Namespace) -> None:
    """Checks that need the raw flags (their effect is gone once translated)."""
    if ns.num_experts is not None and any(n != 1 for n in ns.num_experts):
        raise ConfigError(f"--num-experts {' '.join(map(str, ns.num_experts))}: mixture-of-"
                          "experts layers are not supported; only 1 (a dense MLP)")
    if ns.fp16 and ns.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive")
    if ns.checkpoint_activations and ns.recompute_granularity == "selective":
        raise ConfigError("--checkpoint-activations (full recomputation) conflicts with "
                          "--recompute-granularity selective")
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and "
                          "--use-checkpoint-opt_param-scheduler are mutually exclusive")
    if ns.weight_decay_incr_style == "constant":
        if ns.start_weight_decay is not None or ns.end_weight_decay is not None:
            raise ConfigError("--start-weight-decay/--end-weight-decay need "
                              "--weight-decay-incr-style linear or cosine")
    elif ns.start_weight_decay is None or ns.end_weight_decay is None:
        raise ConfigError(f"--weight-decay-incr-style {ns.weight_decay_incr_style} needs "
                          "--start-weight-decay and --end-weight-decay")
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        _check_virtual_pipeline_flag(ns)


def _check_virtual_pipeline_flag(ns: argparse.Namespace) -> None:
    per_chunk, pp = ns.num_layers_per_virtual_pipeline_stage, ns.pipeline_model_parallel_size
    name = "--num-layers-per-virtual-pipeline-stage"
    # Megatron-DeepSpeed requires pp > 2: with 2 stages the interleaved schedule would batch
    # several sends and receives between the same two ranks (Megatron-LM relaxes this only
    # with its overlapped p2p communication, which this framework does not have).
    if pp <= 2:
        raise ConfigError(f"{name} ({per_chunk}) needs --pipeline-model-parallel-size > 2, "
                          f"got {pp}")
    if ns.decoder_first_pipeline_num_layers is not None or \
            ns.decoder_last_pipeline_num_layers is not None:
        raise ConfigError(f"{name} cannot be combined with --decoder-first-pipeline-num-layers/"
                          "--decoder-last-pipeline-num-layers")
    if per_chunk < 1:
        raise ConfigError(f"{name} must be positive, got {per_chunk}")
    if ns.num_layers % pp != 0:
        raise ConfigError(f"--num-layers ({ns.num_layers}) is not divisible by "
                          f"--pipeline-model-parallel-size ({pp})")
    if (ns.num_layers // pp) % per_chunk != 0:
        raise ConfigError(f"{name} ({per_chunk}) does not divide the layers per pipeline stage: "
                          f"--num-layers ({ns.num_layers}) / --pipeline-model-parallel-size "
                          f"({pp}) = {ns.num_layers // pp}")


def _translate(ns: argparse.Namespace, world_size: int) -> None:
    """Old aliases and derived values -> the config fields they stand for."""
    ns.world_size = world_size
    _translate_recompute(ns)
    ns.activation = "gelu_tanh" if ns.openai_gelu else "gelu"
    ns.params_dtype = torch.float16 if ns.fp16 else torch.bfloat16 if ns.bf16 else torch.float32
    if ns.bf16:
        ns.accumulate_allreduce_grads_in_fp32 = True  # bf16 grads are reduced in fp32 (Megatron)
    if ns.weight_decay_incr_style == "constant":
        ns.start_weight_decay = ns.end_weight_decay = ns.weight_decay
    ns.virtual_pipeline_model_parallel_size = None
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        chunks = ns.num_layers // ns.pipeline_model_parallel_size
        vp = chunks // ns.num_layers_per_virtual_pipeline_stage
        ns.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    for dest, spelling in NO_OP_FLAGS.items():
        # A "--no-x" flag stores False when given; the others store True.
        if dest != "local_rank" and getattr(ns, dest) != spelling.startswith("--no-"):
            logger.info("%s is accepted for compatibility and has no effect", spelling)


def _translate_recompute(ns: argparse.Namespace) -> None:
    if ns.checkpoint_activations:
        ns.recompute_granularity = "full"
        ns.recompute_method = ns.recompute_method or "uniform"
    elif ns.recompute_activations and ns.recompute_granularity is None:
        ns.recompute_granularity = "selective"
    if ns.recompute_granularity == "selective" and ns.recompute_method is not None:
        raise ConfigError(f"--recompute-method ({ns.recompute_method}) applies only to "
                          "--recompute-granularity full, not selective")
    if ns.distribute_checkpointed_activations and ns.recompute_granularity != "full":
        raise ConfigError("--distribute-checkpointed-activations needs full recomputation "
                          "(--checkpoint-activations or --recompute-granularity full)")
    if ns.recompute_granularity != "full":
        ns.recompute_num_layers = None


def _fill(cls: type, ns: argparse.Namespace, drop: tuple[str, ...] = ()) -> Any:
    """An instance of config dataclass ``cls`` from the namespace fields of the same name."""
    kwargs = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(cls)
        if f.init and hasattr(ns, f.name) and f.name not in drop
    }
    try:
        return cls(**kwargs)
    except TypeError as error:  # a field with no default that no flag provides
        raise ConfigError(f"cannot build {cls.__name__} from the flags: {error}") from None


def _build_run_config(ns: argparse.Namespace, extra_dests: set[str]) -> RunConfig:
    parallel = _fill(ParallelConfig, ns)
    ns.sequence_parallel = parallel.sequence_parallel  # turned off at tensor-parallel size 1
    # The model's vocab_size is the tokenizer's; --vocab-size only sizes a NullTokenizer.
    model = _fill(ModelConfig, ns, drop=() if ns.vocab_size else ("vocab_size",))
    slices = {"model": model, "parallel": parallel}
    for name, cls in _SLICE_CLASSES.items():
        if name not in slices:
            slices[name] = _fill(cls, ns)
    return RunConfig(**slices, extra={dest: getattr(ns, dest) for dest in sorted(extra_dests)})


def unmapped_flags(parser: Optional[argparse.ArgumentParser] = None) -> list[str]:
    """Parser destinations that no config field receives (should be empty; a test checks)."""
    fields = {f.name for cls in _SLICE_CLASSES.values() for f in dataclasses.fields(cls)}
    handled = fields | set(NO_OP_FLAGS) | set(TRANSLATED_FLAGS)
    return sorted(_dests(parser or build_parser()) - handled)


# ----------------------------------------------------------------------------- printing


def flatten_config(config: RunConfig) -> dict[str, Any]:
    """Every field of every slice by name (one entry per name), plus derived sizes and extras."""
    flat: dict[str, Any] = {}
    for slice_name in RunConfig.SLICES:
        sub = getattr(config, slice_name)
        for f in dataclasses.fields(sub):
            flat.setdefault(f.name, getattr(sub, f.name))
    flat["data_parallel_size"] = config.data_parallel_size
    flat["padded_vocab_size"] = config.model.padded_vocab_size
    flat["num_micro_batches"] = config.num_microbatches
    flat.update(config.extra)
    return flat


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def print_config(
    config: RunConfig, print_fn: Optional[Callable[[str], None]] = None
) -> str:
    """Log the resolved config as Megatron's ``arguments`` block (on rank 0); returns the text."""
    flat = flatten_config(config)
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(flat, key=str.lower):
        value = flat[name]
        if isinstance(value, torch.dtype):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        lines.append(f"  {name} {'.' * (48 - len(name))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    text = "\n".join(lines)
    if _rank() == 0:
        (print_fn or (lambda s: print(s, flush=True)))(text)
    return text

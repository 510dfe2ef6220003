"""Flags that are not fields: old spellings translated into fields, and Megatron flags that
are accepted so users' scripts run unchanged but have nothing to do here.

A no-op flag logs one notice when given. A translated flag is resolved into the fields it
stands for before the slices are built, so the slices only ever see one spelling.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.config.base import ConfigError
from megatron.platform.output import print_rank_0  # rank 0 only, before and after start-up


@dataclass(frozen=True)
class NoOpFlag:
    spelling: str
    reason: str
    takes_value: bool = False  # e.g. --transformer-impl NAME; announced when given

    @property
    def stores_false(self) -> bool:
        return self.spelling.startswith("--no-")


_FUSED = "fused kernels are optional accelerators, chosen automatically"
NO_OP_FLAGS = {
    "masked_softmax_fusion": NoOpFlag("--no-masked-softmax-fusion", _FUSED),
    "bias_gelu_fusion": NoOpFlag("--no-bias-gelu-fusion", _FUSED),
    "bias_dropout_fusion": NoOpFlag("--no-bias-dropout-fusion", _FUSED),
    "async_tensor_model_parallel_allreduce": NoOpFlag(
        "--no-async-tensor-model-parallel-allreduce", _FUSED),
    "persist_layer_norm": NoOpFlag("--no-persist-layer-norm", _FUSED),
    "apply_query_key_layer_scaling": NoOpFlag(
        "--no-query-key-layer-scaling", "the softmax always runs in fp32, which is what the "
        "scaling protects"),
    "fp32_residual_connection": NoOpFlag(
        "--fp32-residual-connection", "the residual stream stays in the model's dtype"),
    "use_mcore_models": NoOpFlag("--use-mcore-models", "there is one GPT model"),
    "scatter_gather_tensors_in_pipeline": NoOpFlag(
        "--no-scatter-gather-tensors-in-pipeline", "pipeline activations are sent whole"),
    "use_contiguous_buffers_in_local_ddp": NoOpFlag(
        "--use-contiguous-buffers-in-local-ddp", "gradient buffers are always contiguous"),
    "overlap_param_gather": NoOpFlag(
        "--overlap-param-gather", "the distributed optimizer's parameter gather is not "
        "overlapped with compute"),
    "overlap_p2p_comm": NoOpFlag("--overlap-p2p-comm", "pipeline exchanges are not overlapped "
                                 "with compute"),
    "log_memory_to_tensorboard": NoOpFlag(
        "--log-memory-to-tensorboard", "memory is always logged to TensorBoard on a GPU"),
    "log_throughput": NoOpFlag(
        "--log-throughput", "tokens per GPU per second and TFLOP/s per GPU are always in the "
        "log line and in TensorBoard"),
    "use_cpu_initialization": NoOpFlag(
        "--use-cpu-initialization", "weights are always drawn on the CPU as full fp32 master "
        "weights, then split and moved to the device"),
    "local_rank": NoOpFlag("--local_rank", "LOCAL_RANK from the launcher's environment is "
                           "authoritative"),
    # Megatron-LM's later spelling of --overlap-p2p-comm, and its opposite.
    "overlap_p2p_communication": NoOpFlag(
        "--overlap-p2p-communication", "pipeline exchanges are not overlapped with compute"),
    "no_overlap_p2p_communication": NoOpFlag(
        "--no-overlap-p2p-communication", "pipeline exchanges are not overlapped with compute"),
    "rope_fusion": NoOpFlag("--no-rope-fusion", _FUSED),
    "auto_detect_ckpt_format": NoOpFlag(
        "--auto-detect-ckpt-format", "--load always tells a checkpoint's format by its files"),
    "transformer_impl": NoOpFlag(
        "--transformer-impl", "there is one transformer implementation (PyTorch's, with "
        "flash-attn where --use-flash-attn finds it)", takes_value=True),
    "DDP_impl": NoOpFlag("--DDP-impl", "there is one data-parallel wrapper (Megatron's "
                         "local DDP with contiguous gradient buffers)", takes_value=True),
}

# Megatron-LM and Megatron-DeepSpeed flags of features this framework does not have (yet):
# refused by name, saying what they are, instead of guessing a neighbouring flag. An entry
# leaves this table when its feature lands (and becomes a field or a translated flag).
_LLAMA = "planned with the Llama-family models"
_MOE = "this part of mixture-of-experts training is planned"
_EP = "experts are cut over the --tensor-model-parallel-size ranks here"
MISSING_FEATURES = {
    "--qk-layernorm": "layer norms on queries and keys",
    "--apply-layernorm-1p": "zero-centred layer-norm weights",
    "--squared-relu": "squared-ReLU feed-forward layers",
    "--expert-tensor-parallel-size": f"a separate tensor-parallel size for experts; {_EP}",
    "--cpu-optimizer": "ZeRO-Offload's CPU optimizer",
}
MISSING_PREFIXES = {  # families of flags: the first that matches names the feature
    "--moe-": f"this mixture-of-experts option; {_MOE}",
    "--fp8": "FP8 training (Transformer Engine)",
    "--fp4": "FP4 training (Transformer Engine)",
}


def missing_feature(spelling: str) -> Optional[str]:
    """What a Megatron flag of a feature this framework does not have stands for, or None."""
    if spelling in MISSING_FEATURES:
        return MISSING_FEATURES[spelling]
    return next((what for prefix, what in MISSING_PREFIXES.items()
                 if spelling.startswith(prefix)), None)

# Old spellings resolved into fields by ``translate``.
TRANSLATED_FLAGS = ("checkpoint_activations", "recompute_activations",
                    "distribute_checkpointed_activations", "expert_interval",
                    "moe_expert_parallel_size",
                    "use_rotary_position_embeddings", "use_dist_ckpt", "no_position_embedding")


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "old spellings", "Older Megatron flags, turned into the ones above.")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Same as --recompute-granularity full --recompute-method uniform.")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Same as --recompute-granularity selective.")
    g.add_argument("--distribute-checkpointed-activations", "--distribute-saved-activations",
                   action="store_true", dest="distribute_checkpointed_activations",
                   help="Accepted with full recomputation; saved activations are not "
                   "distributed here (off).")
    g.add_argument("--expert-interval", type=int, default=None,
                   help="Megatron-DeepSpeed's: layers N, 2N, ... (1-based) are mixtures of "
                   "experts; becomes the list form of --moe-layer-freq (default: unset).")
    g.add_argument("--moe-expert-parallel-size", type=int, default=None,
                   dest="moe_expert_parallel_size",
                   help="Megatron-DeepSpeed's spelling of --expert-model-parallel-size "
                   "(default: unset).")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-DeepSpeed's spelling of --position-embedding-type rope.")
    g.add_argument("--use-dist-ckpt", action="store_true",
                   help="Megatron-LM's older spelling of --ckpt-format torch_dist.")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="Megatron-LM's: no learned position table (--position-embedding-type "
                   "none; with rope, rope alone).")
    g = parser.add_argument_group(
        "compatibility", "Accepted so Megatron scripts run unchanged; each has no effect here "
        "and says so once when given.")
    for dest, noop in NO_OP_FLAGS.items():
        text = f"No effect: {noop.reason}."
        if dest == "local_rank":
            g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest=dest,
                           help=text + " (default: unset)")
        elif noop.takes_value:
            g.add_argument(noop.spelling, default=None, dest=dest, metavar="NAME",
                           help=text + " (default: unset)")
        else:
            g.add_argument(noop.spelling, action="store_false" if noop.stores_false
                           else "store_true", dest=dest, help=text)


def translate(ns: argparse.Namespace) -> None:
    """Resolve the old spellings into fields; refuse what cannot be honoured."""
    if ns.moe_expert_parallel_size is not None:
        ep, given = ns.expert_model_parallel_size, ns.moe_expert_parallel_size
        if ep not in (1, given):
            raise ConfigError(f"--expert-model-parallel-size ({ep}) and "
                              f"--moe-expert-parallel-size ({given}) disagree: give one")
        ns.expert_model_parallel_size = given
    if ns.expert_interval is not None and ns.num_experts not in (None, 1):
        _translate_expert_interval(ns)  # with one expert Megatron-DeepSpeed ignores it too
    if ns.no_position_embedding and ns.position_embedding_type == "learned_absolute":
        ns.position_embedding_type = "none"
    if ns.use_rotary_position_embeddings:
        ns.position_embedding_type = "rope"
    if ns.use_dist_ckpt:
        ns.ckpt_format = "torch_dist"
    if ns.checkpoint_activations:
        if ns.recompute_granularity == "selective":
            raise ConfigError("--checkpoint-activations (full recomputation) conflicts with "
                              "--recompute-granularity selective")
        ns.recompute_granularity = "full"
        ns.recompute_method = ns.recompute_method or "uniform"
    elif ns.recompute_activations and ns.recompute_granularity is None:
        ns.recompute_granularity = "selective"
    if ns.distribute_checkpointed_activations and ns.recompute_granularity != "full":
        raise ConfigError("--distribute-checkpointed-activations needs full recomputation "
                          "(--checkpoint-activations or --recompute-granularity full)")


def _translate_expert_interval(ns: argparse.Namespace) -> None:
    """Megatron-DeepSpeed's --expert-interval N (layer numbers N, 2N, ... counted from 1 are
    mixtures of experts) as Megatron-LM's per-layer list."""
    n, layers = ns.expert_interval, ns.num_layers
    if n < 1:
        raise ConfigError(f"--expert-interval must be positive, got {n}")
    if ns.moe_layer_freq != "1":
        raise ConfigError(f"--expert-interval ({n}) and --moe-layer-freq ({ns.moe_layer_freq}) "
                          "both say which layers have experts: give one")
    if layers is None or layers < n:
        raise ConfigError(f"--expert-interval ({n}) leaves no mixture-of-experts layer among "
                          f"--num-layers ({layers})")
    ns.moe_layer_freq = "[" + ",".join("1" if (i + 1) % n == 0 else "0"
                                       for i in range(layers)) + "]"


def announce_no_ops(ns: argparse.Namespace) -> list[str]:
    """One notice per no-op flag that was given; returns the flags."""
    given = []
    for dest, noop in NO_OP_FLAGS.items():
        value = getattr(ns, dest)
        if dest == "local_rank" or value == noop.stores_false or (noop.takes_value
                                                                  and value is None):
            continue
        given_as = f"{noop.spelling} {value}" if noop.takes_value else noop.spelling
        print_rank_0(f"> {given_as} is accepted for compatibility and has no effect: "
                     f"{noop.reason}")
        given.append(noop.spelling)
    return given

"""Flags that are not fields: old spellings translated into fields, and Megatron flags that
are accepted so users' scripts run unchanged but have nothing to do here.

A no-op flag logs one notice when given. A translated flag is resolved into the fields it
stands for before the slices are built, so the slices only ever see one spelling.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.config.base import ConfigError


@dataclass(frozen=True)
class NoOpFlag:
    spelling: str
    reason: str

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
}

# Old spellings resolved into fields by ``translate``.
TRANSLATED_FLAGS = ("checkpoint_activations", "recompute_activations",
                    "distribute_checkpointed_activations", "num_experts")


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
    g.add_argument("--num-experts", type=int, nargs="+", default=None,
                   help="Only 1 (a dense MLP), as Megatron-DeepSpeed's dense GPT scripts pass "
                   "(default: unset).")
    g = parser.add_argument_group(
        "compatibility", "Accepted so Megatron scripts run unchanged; each has no effect here "
        "and says so once when given.")
    for dest, noop in NO_OP_FLAGS.items():
        text = f"No effect: {noop.reason}."
        if dest == "local_rank":
            g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest=dest,
                           help=text + " (default: unset)")
        else:
            g.add_argument(noop.spelling, action="store_false" if noop.stores_false
                           else "store_true", dest=dest, help=text)


def translate(ns: argparse.Namespace) -> None:
    """Resolve the old spellings into fields; refuse what cannot be honoured."""
    if ns.num_experts is not None and any(n != 1 for n in ns.num_experts):
        raise ConfigError(f"--num-experts {' '.join(map(str, ns.num_experts))}: mixture-of-"
                          "experts layers are not supported; only 1 (a dense MLP)")
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


def announce_no_ops(ns: argparse.Namespace) -> list[str]:
    """One notice per no-op flag that was given; returns the flags."""
    given = []
    for dest, noop in NO_OP_FLAGS.items():
        value = getattr(ns, dest)
        if dest == "local_rank" or value == noop.stores_false:
            continue
        from megatron.utils import print_rank_0  # rank 0 only, before and after start-up

        print_rank_0(f"> {noop.spelling} is accepted for compatibility and has no effect: "
                     f"{noop.reason}")
        given.append(noop.spelling)
    return given

"""Megatron-DeepSpeed's DeepSpeed flags: the engine behind ``--deepspeed``.

The flags select DeepSpeed's engine (``megatron/integrations/deepspeed/``, the one package
that imports deepspeed): ZeRO stages 0-3, its pipeline engine, its activation checkpointing
and its checkpoints. The JSON file named by ``--deepspeed_config`` is read and checked against
these flags by that module, before any process group exists; the rules that need only flags
are here and in ``RunConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config.base import Slice, flag, option, require

_NEEDS_DEEPSPEED = ("zero_stage", "deepspeed_config", "deepspeed_activation_checkpointing",
                    "no_pipeline_parallel")
_ACTIVATION_SWITCHES = ("partition_activations", "contigious_checkpointing",
                        "checkpoint_in_cpu", "synchronize_each_layer")


@dataclass(frozen=True)
class DeepSpeedConfig(Slice):
    """DeepSpeed engine switches (Megatron-DeepSpeed's spellings)."""

    deepspeed: bool = option(default=False, help="Train with DeepSpeed's engine (ZeRO, its "
                             "pipeline engine and checkpoints) instead of the built-in one.")
    deepspeed_config: Optional[str] = option(
        "--deepspeed_config", "--deepspeed-config", default=None,
        help="DeepSpeed's JSON config; batch sizes and precision must agree with the flags "
        "(default: unset, generated from the flags)")
    zero_stage: Optional[int] = option(
        default=None, choices=(0, 1, 2, 3), help="ZeRO stage; overrides the JSON file's "
        "zero_optimization.stage (default: the file's, else 0)")
    deepspeed_activation_checkpointing: bool = option(
        default=False, help="Recompute activations with DeepSpeed's checkpointing (needs "
        "--recompute-granularity full / --checkpoint-activations).")
    partition_activations: bool = option(
        default=False, help="DeepSpeed activation checkpointing: split each checkpointed "
        "activation over the tensor-parallel ranks.")
    contigious_checkpointing: bool = option(
        default=False, help="DeepSpeed activation checkpointing: copy checkpointed "
        "activations into one contiguous buffer (needs --partition-activations).")
    checkpoint_in_cpu: bool = option(
        default=False, help="DeepSpeed activation checkpointing: keep checkpointed "
        "activations in host memory (needs --partition-activations).")
    synchronize_each_layer: bool = option(
        default=False, help="DeepSpeed activation checkpointing: synchronize the device "
        "at the start and end of each checkpointed layer.")
    no_pipeline_parallel: bool = option(
        default=False, help="Under --deepspeed: the plain model in DeepSpeed's engine, not "
        "its PipelineModule (needs --pipeline-model-parallel-size 1; ZeRO 2 and 3 need it).")

    def __post_init__(self) -> None:
        if not self.deepspeed:
            for name in _NEEDS_DEEPSPEED + _ACTIVATION_SWITCHES:
                value = getattr(self, name)
                require(value in (None, False),
                        f"{flag(name) if name != 'deepspeed_config' else '--deepspeed_config'}"
                        " applies to DeepSpeed's engine: add --deepspeed")
        if not self.deepspeed_activation_checkpointing:
            for name in _ACTIVATION_SWITCHES:
                require(not getattr(self, name), f"{flag(name)} is a setting of DeepSpeed's "
                        "activation checkpointing: add --deepspeed-activation-checkpointing")
        for name in ("contigious_checkpointing", "checkpoint_in_cpu"):
            require(not getattr(self, name) or self.partition_activations,
                    f"{flag(name)} needs --partition-activations (DeepSpeed's rule)")

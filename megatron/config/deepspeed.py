"""Megatron-DeepSpeed's DeepSpeed flags.

DeepSpeed's engine is not wired into this framework yet. Users' scripts pass these flags, and a
run that silently ignored them would train with something else than they asked for, so each
is refused with a message saying so; the built-in engine (data parallel with
``--use-distributed-optimizer`` for ZeRO-1-style sharding) is what trains today.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config.base import Slice, check_refused, option

_NOT_YET = ("DeepSpeed's engine is not wired into this framework yet; drop the DeepSpeed "
            "flags (--deepspeed, --deepspeed_config, --zero-stage, "
            "--deepspeed-activation-checkpointing, --no-pipeline-parallel) to train with the "
            "built-in engine, which shards optimizer state with --use-distributed-optimizer")


@dataclass(frozen=True)
class DeepSpeedConfig(Slice):
    """DeepSpeed engine switches (refused until the engine is wired)."""

    deepspeed: bool = option(default=False, help="Train with DeepSpeed's engine (not "
                             "available yet).", refused=_NOT_YET)
    deepspeed_config: Optional[str] = option(
        "--deepspeed_config", "--deepspeed-config", default=None,
        help="DeepSpeed JSON config (not available yet).", refused=_NOT_YET)
    zero_stage: Optional[int] = option(default=None, choices=(0, 1, 2, 3),
                                       help="ZeRO stage (not available yet).", refused=_NOT_YET)
    deepspeed_activation_checkpointing: bool = option(
        default=False, help="DeepSpeed's activation checkpointing (not available yet).",
        refused=_NOT_YET)
    no_pipeline_parallel: bool = option(
        default=False, help="DeepSpeed engine without its pipeline module (not available "
        "yet).", refused=_NOT_YET)

    def __post_init__(self) -> None:
        check_refused(self)

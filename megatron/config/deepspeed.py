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
_DEEPSPEED_MOE = ("moe_loss_coeff", "moe_train_capacity_factor", "moe_eval_capacity_factor",
                  "moe_min_capacity", "moe_token_dropping", "moe_top2_2nd_expert_sampling",
                  "create_moe_param_group", "mlp_type")
_NEGATED = {"moe_token_dropping": "--disable-moe-token-dropping",
            "moe_top2_2nd_expert_sampling": "--disable-moe-top2-2nd-expert-sampling"}
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

    # DeepSpeed-MoE in place of the built-in MoE layers (Megatron-DeepSpeed's flags):
    # megatron/integrations/deepspeed/moe.py.
    moe_loss_coeff: float = option(
        default=0.1, help="Under --deepspeed with --num-experts: the weight of DeepSpeed-MoE's "
        "load-balancing loss (summed over the layers) added to the language-model loss.")
    moe_train_capacity_factor: float = option(
        default=1.0, help="DeepSpeed-MoE: tokens an expert takes in training, as a multiple "
        "of its even share (x k for top-2), at least --moe-min-capacity.")
    moe_eval_capacity_factor: float = option(
        default=1.0, help="DeepSpeed-MoE: the same in evaluation.")
    moe_min_capacity: int = option(
        default=4, help="DeepSpeed-MoE: the least capacity of an expert.")
    moe_token_dropping: bool = option(
        "--disable-moe-token-dropping", default=True, action="store_false",
        help="DeepSpeed-MoE: no capacity limit (dropless; each expert takes all its tokens).")
    moe_top2_2nd_expert_sampling: bool = option(
        "--disable-moe-top2-2nd-expert-sampling", default=True, action="store_false",
        help="DeepSpeed-MoE top-2: the second expert is the second-best, not drawn by "
        "Gumbel sampling.")
    create_moe_param_group: bool = option(
        default=False, help="DeepSpeed-MoE: expert parameters in their own optimizer groups "
        "(DeepSpeed's ZeRO needs them so; required with --zero-stage 1 or 2).")
    mlp_type: str = option(
        default="standard", choices=("standard", "residual"), help="DeepSpeed-MoE: residual "
        "is PR-MoE (a dense MLP beside the experts, mixed by a learned coefficient).")

    def __post_init__(self) -> None:
        if not self.deepspeed:
            for name in _DEEPSPEED_MOE:
                require(getattr(self, name) == DeepSpeedConfig.__dataclass_fields__[name].default,
                        f"{flag(name) if name not in _NEGATED else _NEGATED[name]} is "
                        "DeepSpeed-MoE's (Megatron-DeepSpeed): add --deepspeed")
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

"""DeepSpeed-MoE in place of the built-in mixture-of-experts layers under ``--deepspeed``,
as Megatron-DeepSpeed trains them: ``deepspeed.moe.layer.MoE`` (its top-1/top-2 gate, its
capacity and token dropping, its expert groups and all-to-alls) with our tensor-parallel MLP
as the expert, and its load-balancing loss, summed over the layers and weighted by
``--moe-loss-coeff``, added to the language-model loss (reported as ``moe loss``).

The model is built with the built-in layers first and each is then swapped
(``use_deepspeed_moe``): DeepSpeed's gate takes the router's weights and its experts the
rank's experts, so a run starts from the same weights whichever engine trains it. DeepSpeed
makes its expert groups when its engine starts; ``check_expert_groups`` then checks that its
expert-parallel groups are ours (the experts a rank took are the ones DeepSpeed gives it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.model.moe import MoELayer

MOE_LOSS = "moe loss"  # Megatron-DeepSpeed's name in the log line


class DeepSpeedMoE(nn.Module):
    """``deepspeed.moe.layer.MoE`` in a layer's MLP place: ``[s, b, h] -> [s, b, h]``; keeps
    the last forward pass's load-balancing loss (``l_aux``) for the engine to add."""

    def __init__(self, layer: MoELayer, ds_config: Any) -> None:
        super().__init__()
        # optional: deepspeed, imported only under --deepspeed
        from deepspeed.moe.layer import MoE

        cfg = layer.config
        self.moe = MoE(cfg.hidden_size, layer.local_experts[0], num_experts=cfg.num_experts,
                       ep_size=layer.ep_size, k=cfg.moe_router_topk,
                       capacity_factor=ds_config.moe_train_capacity_factor,
                       eval_capacity_factor=ds_config.moe_eval_capacity_factor,
                       min_capacity=ds_config.moe_min_capacity,
                       use_residual=ds_config.mlp_type == "residual",
                       drop_tokens=ds_config.moe_token_dropping,
                       top2_2nd_expert_sampling=ds_config.moe_top2_2nd_expert_sampling)
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
            for mine, theirs in zip(layer.local_experts, self.moe.deepspeed_moe.experts
                                    .deepspeed_experts):
                theirs.load_state_dict(mine.state_dict())
        self.first_expert = layer.first_expert
        self.loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.loss, _ = self.moe(x)
        return out


def use_deepspeed_moe(model: nn.Module, ds_config: Any) -> int:
    """Replace every built-in MoE layer's place in ``model`` by DeepSpeed-MoE; returns how
    many were replaced."""
    swapped = 0
    for module in list(model.modules()):
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, MoELayer):
            module.mlp = DeepSpeedMoE(mlp, ds_config)
            swapped += 1
    return swapped


def deepspeed_moe_layers(model: nn.Module) -> list[DeepSpeedMoE]:
    return [m for m in model.modules() if isinstance(m, DeepSpeedMoE)]


def add_moe_loss(model: nn.Module, loss: torch.Tensor, reported: dict,
                 coeff: float) -> tuple[torch.Tensor, dict]:
    """``loss`` plus ``coeff`` x the sum of the layers' load-balancing losses of the last
    forward pass (Megatron-DeepSpeed's ``moe loss``), and the reported values with it."""
    losses = [layer.loss for layer in deepspeed_moe_layers(model) if layer.loss is not None]
    if not losses:
        return loss, reported
    moe_loss = torch.stack(losses).sum() * coeff
    return loss + moe_loss, {**reported, MOE_LOSS: moe_loss.detach()}


def check_expert_groups(model: nn.Module) -> None:
    """Raise unless DeepSpeed's expert-parallel group of each layer holds the ranks of ours
    (the experts copied into a layer are those of our group's place)."""
    # optional: deepspeed, imported only under --deepspeed
    from deepspeed.utils import groups

    layers = deepspeed_moe_layers(model)
    if not layers or layers[0].moe.ep_size == 1:
        return
    name = layers[0].moe.expert_group_name
    theirs = dist.get_process_group_ranks(groups._get_expert_parallel_group(name))
    ours = dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())
    if theirs != ours:
        raise RuntimeError(f"DeepSpeed's expert-parallel group {theirs} is not ours {ours}: "
                           "the experts this rank holds would not be the ones it was given")

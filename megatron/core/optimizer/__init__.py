"""Optimizers: param groups, the torch optimizer, loss scaling and the Megatron wrappers.

``get_megatron_optimizer(config, model_chunks)`` is the one entry point:

- ``--use-distributed-optimizer`` -> ``DistributedOptimizer`` (chunks must be wrapped in
  ``DistributedDataParallel(use_distributed_optimizer=True)``);
- ``--fp16`` / ``--bf16`` -> ``MixedPrecisionOptimizer`` (fp32 main copies);
- otherwise ``FP32Optimizer``.

AccumAdamW (``accum_adamw.py``) is the optimizer of decentralized GPT-2 training; under
``--dp-mode decentralized`` the training loop wraps the result in ``DecentralizedOptimizer``.
Adam is decoupled-weight-decay Adam (``torch.optim.AdamW``, fused on CUDA and CPU; apex's
FusedAdam when apex is installed and the parameters are on CUDA), SGD is ``torch.optim.SGD``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Optional, Union

import torch
from torch import nn

from megatron.config import ConfigError, OptimizerConfig
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.accum_adamw import AccumAdamW
from megatron.core.optimizer.clip_grads import (
    clip_grad_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.optimizer import (
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.platform import xla

ParamCond = Callable[[str, nn.Parameter], bool]


def default_no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.ndim == 1


def get_param_groups(model_chunks: Sequence[nn.Module], weight_decay: float, lr: float,
                     no_weight_decay_cond: Optional[ParamCond] = None,
                     scale_lr_cond: Optional[ParamCond] = None,
                     lr_mult: float = 1.0) -> list[dict]:
    """Trainable parameters grouped by (``wd_mult``, ``lr_mult``), in a fixed group order.

    Each group also carries ``weight_decay`` and ``lr`` already multiplied, so the optimizer
    is right before the scheduler first touches it (the scheduler re-applies the multipliers).
    """
    no_wd = no_weight_decay_cond or default_no_weight_decay
    grouped: dict[tuple[float, float], list[nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in unwrap_model(chunk).named_parameters():
            if not param.requires_grad:
                continue
            wd_mult = 0.0 if no_wd(name, param) else 1.0
            group_lr_mult = lr_mult if scale_lr_cond is not None and scale_lr_cond(name, param) else 1.0
            grouped.setdefault((wd_mult, group_lr_mult), []).append(param)
    # Decayed groups first, then by lr_mult: the order must not depend on which group a
    # chunk happened to fill first, since checkpoints match groups by position.
    keys = sorted(grouped, key=lambda k: (-k[0], k[1]))
    return [
        {"params": grouped[k], "wd_mult": k[0], "lr_mult": k[1],
         "weight_decay": weight_decay * k[0], "lr": lr * k[1]}
        for k in keys
    ]


def _apex_fused_adam():
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def build_torch_optimizer(config: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """The torch optimizer for ``groups`` (the main parameters) from ``--optimizer`` flags."""
    params = [p for g in groups for p in g["params"]]
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    if config.use_syncfree_optim:  # an XLA device's: the NaN/Inf skip stays on the device
        if config.optimizer == "adam":
            return xla.syncfree_optimizer(
                "adam", groups, lr=config.lr, weight_decay=config.weight_decay,
                betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        return xla.syncfree_optimizer("sgd", groups, lr=config.lr,
                                      weight_decay=config.weight_decay,
                                      momentum=config.sgd_momentum)
    if config.optimizer == "adam":
        betas = (config.adam_beta1, config.adam_beta2)
        fused_adam = _apex_fused_adam() if on_cuda else None
        if fused_adam is not None:
            return fused_adam(groups, lr=config.lr, weight_decay=config.weight_decay,
                              betas=betas, eps=config.adam_eps)
        # torch's fused AdamW kernel (CUDA, and CPU since torch 2.4) is one pass over each
        # tensor instead of foreach's dozen; it gives the same numbers.
        on_cpu = bool(params) and all(p.device.type == "cpu" for p in params)
        kwargs = {"fused": True} if on_cuda or on_cpu else {"foreach": True}
        return torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                                 betas=betas, eps=config.adam_eps, **kwargs)
    if config.optimizer == "accumadamw":
        return AccumAdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                          eps=config.adam_eps, weight_decay=config.weight_decay,
                          accum_steps=config.accum_steps)
    return torch.optim.SGD(groups, lr=config.lr, weight_decay=config.weight_decay,
                           momentum=config.sgd_momentum)


def build_grad_scaler(config: OptimizerConfig) -> Optional[MegatronGradScaler]:
    """``--loss-scale`` -> constant; fp16 without it -> dynamic; otherwise none."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
            growth_factor=2.0, backoff_factor=0.5, growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def get_megatron_optimizer(config: OptimizerConfig,
                           model_chunks: Union[nn.Module, Sequence[nn.Module]],
                           no_weight_decay_cond: Optional[ParamCond] = None,
                           scale_lr_cond: Optional[ParamCond] = None,
                           lr_mult: float = 1.0) -> MegatronOptimizer:
    """The optimizer wrapper for ``model_chunks`` (see the module docstring)."""
    if config.lr is None:
        raise ConfigError("--lr is required to build an optimizer")
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    groups = get_param_groups(chunks, config.weight_decay, config.lr, no_weight_decay_cond,
                              scale_lr_cond, lr_mult)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    make = functools.partial(build_torch_optimizer, config)
    grad_scaler = build_grad_scaler(config)
    if config.use_distributed_optimizer:
        return DistributedOptimizer(config, chunks, groups, make, grad_scaler)
    if config.fp16 or config.bf16 or grad_scaler is not None:
        return MixedPrecisionOptimizer(config, groups, make, grad_scaler)
    return FP32Optimizer(config, groups, make)


__all__ = [
    "AccumAdamW",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "build_grad_scaler",
    "build_torch_optimizer",
    "clip_grad_norm_fp32",
    "count_zeros_fp32",
    "default_no_weight_decay",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "get_param_groups",
]

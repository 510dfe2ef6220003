"""Optimizer wrappers: one step protocol over fp32, mixed-precision and sharded optimizers.

Every wrapper holds a torch optimizer over *main* parameters and moves data between them and
the *model* parameters:

- ``FP32Optimizer``: the model parameters are the main parameters.
- ``MixedPrecisionOptimizer``: fp16/bf16 model parameters get fp32 main copies; gradients are
  copied up, unscaled and checked for inf/nan (fp16), and updated values copied back down.
- ``DistributedOptimizer`` (``distrib_optimizer.py``): fp32 main shards, one per
  data-parallel rank.

Model gradients are read from ``param.main_grad`` (the data-parallel wrapper's buffer) when
present, else from ``param.grad``. ``step()`` returns ``(update_successful, grad_norm,
num_zeros)``; the norm is computed when ``--clip-grad`` > 0 or
``--check-for-nan-in-loss-and-grad`` is on (the default), and zeros are only counted with
``--log-num-zeros-in-grad``. With the check on, a step whose gradient norm is NaN/Inf is not
applied: ``(False, grad_norm, None)``, nothing changed (an fp16 overflow is caught earlier by
the loss scaler: ``(False, None, None)``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import is_expert
from megatron.core.optimizer.clip_grads import (
    Groups,
    all_reduce_over,
    clip_grads_by_norm_on_device,
    clip_grads_by_total_norm,
    count_zeros_fp32,
    counted_params,
    get_grad_norm_fp32,
    grad_norm_on_device,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler

# Builds the torch optimizer from param groups (dicts with "params", "lr", "weight_decay", ...).
OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]

# Attributes that tell grad clipping and checkpointing how a parameter is split or shared.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                     "sequence_parallel", "allreduce")


def copy_param_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    for name in _PARAM_ATTRIBUTES:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def model_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The accumulated gradient of a model parameter: ``main_grad`` if wrapped, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def default_model_parallel_groups() -> Groups:
    """The group a replica spans (tensor x pipeline), or None in a single process."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_model_parallel_group()
    return None


def _with_params(groups: Sequence[dict], params: Sequence[Sequence[torch.Tensor]]) -> list[dict]:
    """Copies of ``groups`` (hyper-parameters kept) holding ``params`` instead."""
    return [{**g, "params": list(p)} for g, p in zip(groups, params)]


def shards_state(optimizer: Any) -> bool:
    """Whether ``optimizer`` (any, or None) keeps only this rank's shard of its state."""
    return bool(getattr(optimizer, "shards_state", False))


class MegatronOptimizer(ABC):
    """The step protocol shared by every wrapper (see the module docstring)."""

    # Whether each data-parallel rank holds only its shard of the main weights and optimizer
    # state (the distributed optimizer); what checkpoints ask instead of the class.
    shards_state = False

    def __init__(self, config: OptimizerConfig, optimizer: torch.optim.Optimizer,
                 grad_scaler: Optional[MegatronGradScaler] = None) -> None:
        self.config = config
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self._unit_scale = torch.ones(1, dtype=torch.float32)
        # Further groups that must take the same skip decision (fp16 overflow, non-finite grad
        # norm) though the norm is not reduced over them: the data-parallel group of
        # --dp-mode decentralized, whose replicas do not share gradients.
        self.skip_agreement_groups: Groups = []

    # What subclasses provide -------------------------------------------------------------

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None: ...

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None: ...

    @abstractmethod
    def reload_model_params(self) -> None:
        """Refresh the main parameters from the model's (after loading model weights)."""

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None: ...

    # Hooks of --dp-mode decentralized (core/optimizer/decentralized.py); nothing to do for
    # replicas that average their gradients.

    def start_exchange(self) -> None:
        """Before an iteration's forward and backward."""
        return None

    def cancel_exchange(self) -> None:
        """An iteration that will not step."""
        return None

    def average_replicas(self) -> None:
        """Before a checkpoint is saved."""
        return None

    def norm_groups(self) -> Groups:
        """Groups over which gradient norms, zero counts and inf checks are summed."""
        return default_model_parallel_groups()

    def expert_groups(self) -> Groups:
        """Groups over which the experts' part of those sums runs first: the expert group,
        whose ranks hold different experts (none without expert parallelism)."""
        return [parallel_state.get_expert_model_parallel_group()] \
            if parallel_state.get_expert_model_parallel_world_size() > 1 else []

    def _split_experts(self, params: Sequence[torch.Tensor]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the dense parameters, the experts of expert parallelism) among ``params``."""
        experts = [p for p in params if is_expert(p)]
        return [p for p in params if not is_expert(p)], experts

    def _norm(self, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
              on_device: bool = False):
        """The global norm of ``tensors`` (one per parameter of ``params``), each counted
        once across the ranks of ``norm_groups`` and, for experts, ``expert_groups``."""
        dense = [t for t, p in zip(tensors, params) if not is_expert(p)]
        experts = [t for t, p in zip(tensors, params) if is_expert(p)]
        norm = grad_norm_on_device if on_device else get_grad_norm_fp32
        return norm(dense, self.norm_groups(), experts=experts,
                    expert_groups=self.expert_groups())

    # Shared behaviour --------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's groups; the LR scheduler writes ``lr``/``weight_decay`` here."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def get_main_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a 1-element fp32 tensor (1.0 without a grad scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._unit_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` x loss scale, to call ``backward()`` on (``loss`` itself without a
        grad scaler). The scale is a CPU tensor, so reading it waits for no device."""
        if self.grad_scaler is None:
            return loss
        return loss * float(self.get_loss_scale())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the main parameters' gradients (the DDP buffer is zeroed by the wrapper)."""
        for p in self.get_main_params():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def get_grad_norm(self) -> float:
        """The global L2 norm of the main gradients (every rank of ``norm_groups``)."""
        counted = counted_params(self.get_main_params())
        return self._norm([p.grad for p in counted], counted)

    def count_zeros(self) -> int:
        dense, experts = self._split_experts(self.get_main_params())
        return count_zeros_fp32(dense, self.norm_groups(), experts=experts,
                                expert_groups=self.expert_groups())

    def params_norm(self) -> float:
        """L2 norm of the whole model's (main) parameters, each counted once across ranks, as
        the gradient norm counts them (``--log-params-norm``)."""
        counted = counted_params(self.get_main_params(), with_grad=False)
        return self._norm([p.detach() for p in counted], counted)


    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        grads = [p.grad for p in self.get_main_params() if p.grad is not None]
        device = grads[0].device if grads else parallel_state.get_default_device()
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, self.grad_scaler.inv_scale.to(device))
        # Every rank must skip together, or the replicas (and shards) drift apart; the
        # reduction runs where the collective can carry it.
        found_inf = found_inf.to(parallel_state.get_default_device())
        all_reduce_over(found_inf, self.norm_groups(), dist.ReduceOp.MAX)
        all_reduce_over(found_inf, self.expert_groups(), dist.ReduceOp.MAX)
        all_reduce_over(found_inf, self.skip_agreement_groups, dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def _nonfinite_anywhere(self, grad_norm: float) -> bool:
        """Whether ``grad_norm`` (already agreed over ``norm_groups``) is NaN/Inf here or on
        any rank of ``skip_agreement_groups``; a collective over those groups."""
        if not self.skip_agreement_groups:
            return not math.isfinite(grad_norm)
        flag = torch.tensor([0.0 if math.isfinite(grad_norm) else 1.0],
                            device=parallel_state.get_default_device())
        all_reduce_over(flag, self.skip_agreement_groups, dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    @torch.no_grad()
    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        """One update: ``(update_successful, grad_norm, num_zeros)``.

        An fp16 step whose gradients hold inf/nan is skipped (``(False, None, None)``) and the
        loss scale backs off. With ``check_for_nan_in_loss_and_grad``, a step whose gradient
        norm is not finite is skipped too (``(False, grad_norm, None)``); nothing changes.
        """
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_main_grads_and_check_for_nan()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad(set_to_none=True)  # drop aliases of the DDP buffer
                return False, None, None
        check = self.config.check_for_nan_in_loss_and_grad
        grad_norm = self.get_grad_norm() if self.config.clip_grad > 0 or check else None
        if check and self._nonfinite_anywhere(grad_norm):
            self.zero_grad(set_to_none=True)
            return False, grad_norm, None
        if self.config.clip_grad > 0:
            clip_grads_by_total_norm(self.get_main_params(), self.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    @torch.no_grad()
    def step_on_device(self, loss_nonfinite: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``step()`` decided on the device, for a traced (XLA) step: nothing is read on the
        host. Returns ``(skipped, grad_norm)`` as device tensors (``grad_norm`` None when
        neither clipping nor the NaN check needs it).

        With ``check_for_nan_in_loss_and_grad`` the update is skipped where
        ``loss_nonfinite`` or the gradient norm says NaN/Inf: the torch optimizer must take
        ``found_inf`` (torch_xla's sync-free optimizers, ``--use-syncfree-optim``). Clipping
        scales by ``min(1, clip / norm)`` in the graph. fp16 loss scaling is not offered here
        (its skip and scale update are host decisions).
        """
        if self.grad_scaler is not None:
            raise RuntimeError("a device-decided step has no fp16 loss scaling: use --bf16")
        self._copy_model_grads_to_main_grads()
        check = self.config.check_for_nan_in_loss_and_grad
        grad_norm = None
        if self.config.clip_grad > 0 or check:
            counted = counted_params(self.get_main_params())
            grad_norm = self._norm([p.grad for p in counted], counted, on_device=True)
        skipped = torch.zeros((), dtype=torch.float32, device=parallel_state.get_default_device())
        if check:
            skipped = (~torch.isfinite(grad_norm)).float().reshape(())
            if loss_nonfinite is not None:
                skipped = torch.maximum(skipped, loss_nonfinite.float().reshape(()))
        if self.config.clip_grad > 0:
            clip_grads_by_norm_on_device(self.get_main_params(), self.config.clip_grad,
                                         grad_norm)
        if check:
            self.optimizer.step(found_inf=skipped)
        else:
            self.optimizer.step()
        self._copy_main_params_to_model_params()
        return skipped, grad_norm


class FP32Optimizer(MegatronOptimizer):
    """fp32 training: the torch optimizer steps the model parameters directly."""

    def __init__(self, config: OptimizerConfig, param_groups: Sequence[dict],
                 make_optimizer: OptimizerFactory) -> None:
        super().__init__(config, make_optimizer(_with_params(param_groups,
                                                             [g["params"] for g in param_groups])))

    def _copy_model_grads_to_main_grads(self) -> None:
        for p in self.get_main_params():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad  # same dtype: an alias, no copy

    def _copy_main_params_to_model_params(self) -> None:
        # Drop the aliases of the DDP buffer so the next backward cannot add into it twice.
        for p in self.get_main_params():
            if getattr(p, "main_grad", None) is not None:
                p.grad = None

    def reload_model_params(self) -> None:
        pass

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """fp16/bf16 model parameters with fp32 main copies (fp32 model parameters step as is).

    State dict (Megatron's keys): ``optimizer`` (the torch optimizer's), ``grad_scaler`` and
    ``fp32_from_fp16_params`` (the fp32 main copies, per group).
    """

    def __init__(self, config: OptimizerConfig, param_groups: Sequence[dict],
                 make_optimizer: OptimizerFactory,
                 grad_scaler: Optional[MegatronGradScaler]) -> None:
        if config.fp16 and grad_scaler is None:
            raise ValueError("fp16 training needs a grad scaler (--loss-scale or dynamic)")
        self.model_groups = [list(g["params"]) for g in param_groups]
        self.main_groups = [[self._main_copy(p) for p in group] for group in self.model_groups]
        super().__init__(config, make_optimizer(_with_params(param_groups, self.main_groups)),
                         grad_scaler)

    @staticmethod
    def _main_copy(param: nn.Parameter) -> nn.Parameter:
        if param.dtype == torch.float32:
            return param
        main = nn.Parameter(param.detach().float())
        copy_param_attributes(param, main)
        return main

    def _pairs(self):
        for models, mains in zip(self.model_groups, self.main_groups):
            yield from zip(models, mains)

    def _copy_model_grads_to_main_grads(self) -> None:
        for model, main in self._pairs():
            grad = model_grad(model)
            main.grad = None if grad is None else grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        pairs = [(model, main) for model, main in self._pairs() if main is not model]
        if pairs:
            # One multi-tensor kernel per dtype pair rather than one copy per parameter.
            models, mains = zip(*pairs)
            torch._foreach_copy_([m.data for m in models], [m.data for m in mains])
        for _, main in self._pairs():
            main.grad = None

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model, main in self._pairs():
                if main is not model:
                    main.data.copy_(model.data)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in self.model_groups:
            for p in group:
                p.grad = None

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "fp32_from_fp16_params": [
                [main for model, main in zip(models, mains) if main is not model]
                for models, mains in zip(self.model_groups, self.main_groups)
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and state_dict.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved_groups = state_dict["fp32_from_fp16_params"]
        with torch.no_grad():
            for models, mains, saved in zip(self.model_groups, self.main_groups, saved_groups):
                copies = [main for model, main in zip(models, mains) if main is not model]
                if len(copies) != len(saved):
                    raise ValueError(f"checkpoint has {len(saved)} fp32 main parameters in a "
                                     f"group where the model has {len(copies)}")
                for main, value in zip(copies, saved):
                    main.data.copy_(value)

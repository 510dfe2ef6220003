"""AccumAdamW: AdamW whose moments absorb the gradient once every ``accum_steps`` steps.

The optimizer of "Pre-training GPT-2 on OpenWebText with Decentralized Training" and of its
library, decent-dp (``decent_dp.optim.AccumAdamW``), restated. The parameters move every step;
the moment estimates change only every ``accum_steps`` steps, by the mean of the gradients
since the last change. This keeps Adam's statistics over a large effective batch while each
replica steps (and exchanges parameters with its neighbours) on its own small batch.

Step ``t`` (1-based) of one parameter ``p`` with gradient ``g``, ``A = accum_steps``::

    p   <- p * (1 - lr * weight_decay)                      # decoupled weight decay
    acc <- acc + g / A
    m'  =  m + (1 - beta1) * g                              # m, v as of the last boundary,
    v'  =  v + (1 - beta2) * g^2                            #   already multiplied by beta
    k   =  ceil(t / A)
    p   <- p - lr / (1 - beta1^k) * m' / (sqrt(v') / sqrt(1 - beta2^k) + eps)
    if t % A == 0:
        m <- beta1 * (m + (1 - beta1) * acc);  v <- beta2 * (v + (1 - beta2) * acc^2);  acc <- 0

With ``A = 1`` this is AdamW exactly (``m'`` and ``v'`` are AdamW's moments of step ``t``).
That project's defaults: betas (0.9, 0.98), eps 1e-8, weight decay 0.1, ``accum_steps`` 8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class AccumAdamW(torch.optim.Optimizer):
    """See the module docstring. State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``
    (both held pre-multiplied by beta, as above) and ``accum_grad``."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 weight_decay: float = 0.1, accum_steps: int = 8) -> None:
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        accum_steps=accum_steps)
        super().__init__(params, defaults)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for name in ("exp_avg", "exp_avg_sq", "accum_grad"):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AccumAdamW takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return None

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd, steps = group["lr"], group["eps"], group["weight_decay"], \
            group["accum_steps"]
        state = self._state_of(p)
        state["step"] += 1
        t = int(state["step"].item())
        if wd != 0:
            p.mul_(1 - lr * wd)
        acc, m, v = state["accum_grad"], state["exp_avg"], state["exp_avg_sq"]
        acc.add_(g, alpha=1.0 / steps)
        m_now = m.add(g, alpha=1 - beta1)
        v_now = v.addcmul(g, g, value=1 - beta2)
        k = (t + steps - 1) // steps
        denom = v_now.sqrt_().div_(math.sqrt(1 - beta2 ** k)).add_(eps)
        p.addcdiv_(m_now, denom, value=-lr / (1 - beta1 ** k))
        if t % steps == 0:
            m.add_(acc, alpha=1 - beta1).mul_(beta1)
            v.addcmul_(acc, acc, value=1 - beta2).mul_(beta2)
            acc.zero_()

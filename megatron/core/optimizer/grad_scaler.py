"""Loss scaling for fp16 training: a constant scale, or Megatron's dynamic scale with hysteresis.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to
zero; the optimizer divides the gradients by it again (``inv_scale``) before the update.
"""

from __future__ import annotations

import torch


class MegatronGradScaler:
    """Holds the current loss scale; ``update(found_inf)`` is called once per optimizer step."""

    def __init__(self, initial_scale: float) -> None:
        if initial_scale <= 0.0:
            raise ValueError(f"loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale as a 1-element fp32 tensor."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale``): overflowing steps are skipped, the scale stays."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale.

    On an overflow the growth count restarts and the hysteresis count drops by one; once it
    reaches zero every further overflow multiplies the scale by ``backoff_factor`` (never below
    ``min_scale``). After ``growth_interval`` clean steps in a row the scale grows by
    ``growth_factor`` and the hysteresis count is restored. Overflows that go on at the
    minimum scale are the training loop's to stop (megatron/core/nonfinite.py OverflowGuard).
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2) -> None:
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"min loss scale must be in (0, {initial_scale}], got {min_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("growth factor must be > 1 and backoff factor in (0, 1)")
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError("growth interval and hysteresis must be positive")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if not found_inf:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor
            return
        self._growth_tracker = 0
        self._hysteresis_tracker -= 1
        if self._hysteresis_tracker <= 0:
            self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = state_dict["scale"].detach().to("cpu", torch.float32).reshape(1).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])

"""Deterministic weight initialisation that does not depend on the parallel layout.

Every module draws its weights from its own generator, seeded from the run's seed and a
stable name (``"layer7"``, ``"word_embeddings"``). Master weights are drawn at full size and
then split, so tensor-parallel size, pipeline split and virtual chunks all give the same
model for the same seed, with no communication.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Optional

import torch

from megatron.config import ModelConfig


def derive_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


class InitRNG:
    """Init methods for one named module, all drawing from one generator in call order."""

    def __init__(self, config: ModelConfig, key: str) -> None:
        self.enabled = config.perform_initialization
        self.std = config.init_method_std
        self.num_layers = config.num_layers
        self.generator = torch.Generator().manual_seed(derive_seed(config.seed, key))

    def _normal(self, std: float) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        if not self.enabled:
            return None
        return lambda w: torch.nn.init.normal_(w, 0.0, std, generator=self.generator)

    def normal(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """N(0, init_method_std)."""
        return self._normal(self.std)

    def scaled_normal(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """N(0, init_method_std / sqrt(2 num_layers)) for projections into the residual
        stream, as GPT-2 does."""
        return self._normal(self.std / math.sqrt(2.0 * self.num_layers))

"""Which global layers each pipeline stage (and virtual chunk) builds.

The per-stage layer counts come from ``megatron.run_config.split_pipeline_layers`` (uniform, or
with ``--decoder-first/last-pipeline-num-layers``); this module places them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from megatron.config import ConfigError


def layer_range(stage_layers: Sequence[int], pipeline_rank: int = 0,
                virtual_size: Optional[int] = None, virtual_rank: int = 0) -> tuple[int, int]:
    """``(first_global_layer, count)`` for one stage, or one virtual chunk of a stage.

    With interleaving (``virtual_size`` v > 1) the model is cut into ``p * v`` equal chunks and
    stage i holds chunks ``i, i + p, i + 2p, ...`` (Megatron's layout), which needs a uniform
    split.
    """
    if not virtual_size or virtual_size == 1:
        return sum(stage_layers[:pipeline_rank]), stage_layers[pipeline_rank]
    p, num_layers = len(stage_layers), sum(stage_layers)
    if len(set(stage_layers)) != 1 or num_layers % (p * virtual_size) != 0:
        raise ConfigError(
            f"interleaving needs --num-layers ({num_layers}) split evenly over "
            f"--pipeline-model-parallel-size ({p}) x virtual stages ({virtual_size}); "
            f"stages hold {list(stage_layers)}")
    per_chunk = num_layers // (p * virtual_size)
    return (virtual_rank * p + pipeline_rank) * per_chunk, per_chunk

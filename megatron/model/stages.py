"""Which global layers each pipeline stage (and virtual chunk) builds."""

from __future__ import annotations

from typing import Optional

from megatron.config import ConfigError


def stage_layer_counts(num_layers: int, pipeline_size: int,
                       first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None) -> list[int]:
    """Layers per stage: uniform, or with the first/last stage's count fixed and the rest
    spread evenly over the middle stages."""
    if pipeline_size == 1:
        return [num_layers]
    counts: list[Optional[int]] = [None] * pipeline_size
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    remaining = num_layers - fixed
    if remaining < 0 or (free and remaining % len(free) != 0) or (not free and remaining != 0):
        raise ConfigError(
            f"--num-layers ({num_layers}) cannot be split over --pipeline-model-parallel-size "
            f"({pipeline_size}) stages with --decoder-first-pipeline-num-layers "
            f"({first_stage_layers}) and --decoder-last-pipeline-num-layers ({last_stage_layers})"
        )
    for i in free:
        counts[i] = remaining // len(free)
    return [int(c) for c in counts]


def layer_range(num_layers: int, pipeline_size: int = 1, pipeline_rank: int = 0,
                virtual_size: Optional[int] = None, virtual_rank: int = 0,
                first_stage_layers: Optional[int] = None,
                last_stage_layers: Optional[int] = None) -> tuple[int, int]:
    """``(first_global_layer, count)`` for one stage, or one virtual chunk of a stage.

    With interleaving (``virtual_size`` v > 1) the model is cut into ``p * v`` equal chunks and
    stage i holds chunks ``i, i + p, i + 2p, ...``; Megatron's layout.
    """
    if not virtual_size or virtual_size == 1:
        counts = stage_layer_counts(num_layers, pipeline_size, first_stage_layers,
                                    last_stage_layers)
        return sum(counts[:pipeline_rank]), counts[pipeline_rank]
    if first_stage_layers is not None or last_stage_layers is not None:
        raise ConfigError("uneven pipeline splits cannot be combined with "
                          "--num-layers-per-virtual-pipeline-stage")
    chunks = pipeline_size * virtual_size
    if num_layers % chunks != 0:
        raise ConfigError(
            f"--num-layers ({num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({pipeline_size}) x virtual stages ({virtual_size})"
        )
    per_chunk = num_layers // chunks
    return (virtual_rank * pipeline_size + pipeline_rank) * per_chunk, per_chunk

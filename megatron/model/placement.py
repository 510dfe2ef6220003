"""Chunk placement: which global transformer layers each pipeline stage's model chunks hold.

The one rule training, the planner, inference loading, checkpoint conversion, the rehearsal
and the benchmarks use. A stage holds one chunk, or v chunks under interleaving (virtual
pipeline stages; chunk ``v`` of stage ``p`` is model part ``v * pp + p``, Megatron's layout).
The layer counts per stage come from ``megatron.config`` (``split_pipeline_layers``: even, or
with --decoder-first/last-pipeline-num-layers); the first chunk of the first stage holds the
embeddings (``pre_process``), the last chunk of the last stage the final LayerNorm and the LM
head (``post_process``).
Parameter names and each one's tensor-parallel cut are ``megatron.model.names``'.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from megatron.config import RunConfig
from megatron.config.parallel import layer_range, split_pipeline_layers


class Chunk(NamedTuple):
    """One model chunk of one pipeline stage: its global layers and what else it holds."""

    pp_rank: int
    virtual_rank: int
    first_layer: int
    num_layers: int
    pre_process: bool
    post_process: bool


def pipeline_chunks(num_layers: int, pp: int, vp: Optional[int] = None,
                    first_stage_layers: Optional[int] = None,
                    last_stage_layers: Optional[int] = None) -> list[list[Chunk]]:
    """Per pipeline rank, its chunks (one per virtual stage)."""
    stages = split_pipeline_layers(num_layers, pp, first_stage_layers, last_stage_layers)
    vp = vp or 1
    out = []
    for p in range(pp):
        chunks = []
        for v in range(vp):
            first, count = layer_range(stages, p, vp, v)
            chunks.append(Chunk(p, v, first, count, p == 0 and v == 0,
                                p == pp - 1 and v == vp - 1))
        out.append(chunks)
    return out


def run_chunks(config: RunConfig, *, interleaved: bool = True) -> list[list[Chunk]]:
    """Per pipeline rank, the chunks ``config``'s run builds; ``interleaved=False`` gives one
    chunk per stage (all its layers) whatever the virtual pipeline size, as inference does."""
    p = config.parallel
    return pipeline_chunks(config.model.num_layers, p.pipeline_model_parallel_size,
                           p.virtual_pipeline_model_parallel_size if interleaved else None,
                           p.decoder_first_pipeline_num_layers,
                           p.decoder_last_pipeline_num_layers)


def stage_chunks(config: RunConfig, pp_rank: int, *, interleaved: bool = True) -> list[Chunk]:
    """The chunks pipeline rank ``pp_rank`` of ``config``'s run holds."""
    return run_chunks(config, interleaved=interleaved)[pp_rank]

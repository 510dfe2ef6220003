"""Assembling a run: one owner for what every entry point builds the same way.

- ``megatron/model/placement.py`` (re-exported here): which layers each pipeline chunk holds
  (``Chunk``, ``pipeline_chunks``, ``run_chunks``, ``stage_chunks``) and the tensor-parallel
  cut; it depends on the config only and sits outside this package, so checkpoints and
  conversion use it without importing the builders;
- ``build``: the run context, the model chunks, the data-parallel (or decentralized)
  wrappers, the optimizer and LR schedule, the tokenizer.

Training (``megatron.training`` keeps the loop), evaluation, text generation (through
``megatron.inference.loading``), the planner, conversion and the rehearsal all build here.
"""

from megatron.model.placement import Chunk, pipeline_chunks, run_chunks, stage_chunks

__all__ = ["Chunk", "pipeline_chunks", "run_chunks", "stage_chunks"]

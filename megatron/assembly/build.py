"""Building a run's pieces on this rank: the run context, the model chunks, their wrappers, the
optimizer with its LR schedule, and the tokenizer.

``pretrain`` (megatron/training.py), evaluation, the planner and the rehearsal build through
these functions, so each rank of every one of them gets the same chunks (``placement``), the
same wrappers and the same optimizer as training.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import ConfigError, ModelConfig, OptimizerConfig, RunConfig
from megatron.core import parallel_state, watchdog
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.gossip import ParameterGossip, TopologyError, topology_rounds
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.decentralized import DecentralizedOptimizer
from megatron.core.optimizer_param_scheduler import build_optimizer_param_scheduler
from megatron.core.timers import Timers
from megatron.model.gpt_model import GPTModel
from megatron.model.placement import Chunk, stage_chunks
from megatron.model.transformer import compile_transformer_layers
from megatron.platform import xla
from megatron.platform.output import print_rank_0
from megatron.tokenizer import build_tokenizer


@dataclasses.dataclass
class RunContext:
    """What the callbacks may need: the resolved config, the tokenizer, the timers."""

    config: RunConfig
    tokenizer: Any = None
    timers: Timers = dataclasses.field(default_factory=Timers)
    device: torch.device = torch.device("cpu")
    # What this rank is doing now: the hang watchdog and the timeout report name it.
    progress: watchdog.Progress = dataclasses.field(default_factory=watchdog.Progress)
    # Under XLA SPMD: the devices' mesh, along which each micro-batch is split.
    spmd_mesh: Any = None

    def batch_to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A micro-batch ``[b, ...]`` from the data loader on the run's device (pinned by the
        loader on a GPU, so the copy need not wait for the host); under XLA SPMD split along
        ``b`` over the devices, each holding one data-parallel rank's rows."""
        if self.spmd_mesh is not None:
            return xla.to_device_split(batch, self.spmd_mesh)
        return batch.to(self.device, non_blocking=True)


# Tokenizer ---------------------------------------------------------------------------------


def build_run_tokenizer(cfg: RunConfig):
    """The tokenizer named by the data flags; with --mock-data and no files, none (the
    vocabulary size then comes from --vocab-size or GPT-2's 50257)."""
    d = cfg.data
    has_files = d.vocab_file or d.tokenizer_name_or_path
    if d.mock_data and d.tokenizer_type != "NullTokenizer" and not has_files:
        return None
    return build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file,
                           d.tokenizer_name_or_path, d.vocab_size)


def run_vocab_size(cfg: RunConfig, tokenizer) -> int:
    """The vocabulary the model is built for: the tokenizer's, else --vocab-size, else
    GPT-2's 50257."""
    return tokenizer.vocab_size if tokenizer is not None else (cfg.data.vocab_size or 50257)


# Model -------------------------------------------------------------------------------------


def build_gpt_chunk(model_config: ModelConfig, chunk: Chunk,
                    device: Optional[torch.device] = None) -> GPTModel:
    """The GPTModel of one chunk (its layers, and the embeddings / LM head where it has them)."""
    return GPTModel(model_config, pre_process=chunk.pre_process,
                    post_process=chunk.post_process, first_layer=chunk.first_layer,
                    num_layers=chunk.num_layers, device=device)


def gpt_model_provider(ctx: RunContext, pre_process: bool = True, post_process: bool = True,
                       first_layer: int = 0, num_layers: Optional[int] = None) -> GPTModel:
    """Megatron's ``model_provider`` for our GPTModel, on the run's device."""
    return GPTModel(ctx.config.model, pre_process=pre_process, post_process=post_process,
                    first_layer=first_layer, num_layers=num_layers, device=ctx.device)


def build_model_chunks(model_provider: Callable, ctx: RunContext,
                       pp_rank: Optional[int] = None) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), each built by
    ``model_provider`` for its layers; ``pp_rank`` defaults to this rank's pipeline stage."""
    cfg = ctx.config
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = [model_provider(ctx, pre_process=c.pre_process, post_process=c.post_process,
                             first_layer=c.first_layer, num_layers=c.num_layers)
              for c in stage_chunks(cfg, pp_rank)]
    if cfg.training.compile:
        compiled = sum(compile_transformer_layers(chunk) for chunk in chunks)
        print_rank_0(f"> --compile: {compiled} transformer layers on this rank go through "
                     "torch.compile (compiled on first use)")
    return chunks


def num_parameters(chunks: Sequence[nn.Module]) -> int:
    # ZeRO-3 leaves each rank a shard; ds_numel is the whole parameter's size.
    return sum(getattr(p, "ds_numel", p.numel()) for chunk in chunks for p in chunk.parameters())


# Wrappers ----------------------------------------------------------------------------------


def gradients_in_fp32(opt: OptimizerConfig) -> bool:
    """Whether the data-parallel gradient buffers are fp32: for fp32 models, and with
    --accumulate-allreduce-grads-in-fp32 (which --bf16 turns on); else the params dtype."""
    return opt.accumulate_allreduce_grads_in_fp32 or not (opt.fp16 or opt.bf16)


def wrap_data_parallel(chunks: Sequence[nn.Module], cfg: RunConfig) -> list[nn.Module]:
    opt = cfg.optimizer
    return [
        DistributedDataParallel(
            chunk, accumulate_allreduce_grads_in_fp32=gradients_in_fp32(opt),
            overlap_grad_reduce=opt.overlap_grad_reduce,
            use_distributed_optimizer=opt.use_distributed_optimizer,
            bucket_size=opt.ddp_bucket_size,
            average_gradients=cfg.parallel.dp_mode == "allreduce",
            gradient_accumulation_fusion=opt.gradient_accumulation_fusion)
        for chunk in chunks
    ]


def dp_ranks_per_node(cfg: RunConfig) -> int:
    """Data-parallel ranks of one node for --dp-topology alternating-exp-ring. Ranks go tensor
    fastest, then data, then pipeline: a node's LOCAL_WORLD_SIZE consecutive ranks hold
    LOCAL_WORLD_SIZE / tp consecutive data-parallel ranks of one stage."""
    p = cfg.parallel
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // p.tensor_model_parallel_size
    return min(max(per_node, 1), p.data_parallel_size)


def check_dp_topology_or_exit(cfg: RunConfig) -> None:
    """A --dp-topology this run's sizes cannot build ends the run before any process group."""
    p = cfg.parallel
    if p.dp_mode != "decentralized":
        return
    try:
        topology_rounds(p.dp_topology, p.data_parallel_size, dp_ranks_per_node(cfg))
    except TopologyError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def wrap_decentralized(optimizer, cfg: RunConfig):
    """--dp-mode decentralized: the optimizer that averages with --dp-topology neighbours."""
    p = cfg.parallel
    groups = parallel_state.build_rank_groups(
        dist.get_world_size() if dist.is_initialized() else 1,
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size).data
    try:
        gossip = ParameterGossip(p.dp_topology, groups, dp_ranks_per_node(cfg),
                                 full_group=parallel_state.get_data_parallel_group())
    except TopologyError as error:
        raise ConfigError(str(error)) from None
    when = ("while it computes its gradient (--dp-overlap)" if p.dp_overlap
            else "after each step")
    print_rank_0(f"> --dp-mode decentralized: gradients are not all-reduced; {when} "
                 f"every replica averages its parameters over its --dp-topology {p.dp_topology} "
                 f"group ({gossip.num_rounds()} round(s), data-parallel size {gossip.dp_size})")
    return DecentralizedOptimizer(optimizer, gossip, overlap=p.dp_overlap)


# Optimizer ---------------------------------------------------------------------------------


def setup_model_and_optimizer(model_provider: Callable, ctx: RunContext):
    """This rank's wrapped model chunks, the optimizer over them and its LR schedule."""
    cfg = ctx.config
    chunks = wrap_data_parallel(build_model_chunks(model_provider, ctx), cfg)
    optimizer = get_megatron_optimizer(cfg.optimizer, chunks)
    if cfg.parallel.dp_mode == "decentralized":
        optimizer = wrap_decentralized(optimizer, cfg)
    scheduler = build_optimizer_param_scheduler(
        cfg.scheduler, cfg.optimizer, optimizer,
        global_batch_size=cfg.training.global_batch_size,
        train_iters=cfg.training.train_iters, train_samples=cfg.training.train_samples)
    return chunks, optimizer, scheduler

"""What a launch needs to know per rank: parameters, memory by kind and communication volume
per iteration by kind, at the run's real size, with the fullest and the emptiest rank side by
side and the whole run's totals.

Parameters and memory are the planner's (``megatron.planning.planner``: every stage built on the meta
device at the real size). Communication per iteration is ``comm_volume``'s closed form below,
evaluated at the real size. Both are cross-checked against the rehearsal, which ran at its
own (possibly smaller) size: the planner and the formula evaluated at that size must give what
the rehearsed ranks held (``megatron.planning.rehearsal.memory``) and issued (their records).

Communication per iteration of one rank, payload bytes (see ``records``), with s tokens per
sequence, b the micro-batch, h the hidden size, t the tensor-parallel size, e the bytes of the
params dtype, m the iteration's micro-batches, L the rank's layers, and t_sp = t under
--sequence-parallel, else 1::

    tensor all-reduce       no SP: 4 s b h e per layer per micro-batch (attention output and
                            MLP output forward, their inputs' gradients backward), + 2 more per
                            layer recomputed under --recompute-granularity full; the first
                            stage's embedding s b h e; the last stage's LM-head input gradient
                            s b h e and the cross entropy's 3 s b x 4 bytes
    tensor all-gather and   SP: 4 s b h e each per layer per micro-batch (+ 2 each recomputed),
    reduce-scatter          and 2 more all-gathers per layer (the QKV and FC1 inputs, gathered
                            again in the backward); the LM head's input s b h e each; the
                            cross entropy as above (an
                            all-reduce); once per iteration the all-reduce of the sequence-
                            parallel parameters' gradients (LayerNorms, row-parallel biases)
    pipeline send / recv    s b h e / t_sp per micro-batch and direction, for each chunk of the
                            stage that has a neighbour that way
    data-parallel reduce    the rank's parameters x gradient bytes (all-reduce, or reduce-
                            scatter with --use-distributed-optimizer); the experts of expert
                            parallelism over their expert-data ranks (none when that is 1)
    data-parallel gather    the rank's parameters x param bytes (distributed optimizer)
    expert dispatch         per MoE layer per micro-batch, the dispatch's forward and backward
                            payload (megatron/planning/experts.py: balanced routing, as the
                            rehearsal routes), + the forward's again per recomputed MoE layer
    MoE layers, tensor      in place of the MLP's 2 s b h e all-reduces: R h e forward and
                            backward for the experts' rows (R: experts.py), 2 s b h e for a
                            shared expert; under SP 2 all-gathers of s b h e (the layer gathers
                            the sequence, and its output's gradient), no reduce-scatter
    embedding all-reduce    first and last stage, tied embeddings: (V/t) h x gradient bytes
    other                   scalars (loss, gradient norm, overflow and NaN flags): as recorded
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

from megatron.config import RunConfig
from megatron.core.distributed.distributed_data_parallel import is_expert
from megatron.core.microbatches import NumMicroBatchesCalculator
from megatron.planning import experts
from megatron.planning.planner import (
    GB,
    Plan,
    build_plan,
    build_rank_on_meta,
    bytes_of,
    grad_bytes,
    stage_moe_flags,
)
from megatron.planning.rehearsal.ranks import RankGrid, RankPlan, group_kinds
from megatron.planning.rehearsal.recorder import SMALL
from megatron.planning.rehearsal.records import CommOp
from megatron.planning.rehearsal.runner import RankResult

VOLUME_KINDS = ("tp all-reduce", "tp all-gather", "tp reduce-scatter", "pp send", "pp recv",
                "dp reduce", "dp gather", "ep dispatch", "embedding all-reduce", "other")
# The module that moves tokens to their experts (its collectives are the dispatch's, also on
# an expert group that is the data group too).
DISPATCH_SITE = "megatron/core/expert_parallel.py"
MEMORY_KINDS = ("weights", "gradients", "optimizer", "activations")


def iteration_microbatches(cfg: RunConfig) -> int:
    """Micro-batches of the first iteration ``cfg`` runs (the ramp-up's START where set)."""
    t = cfg.training
    return NumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size,
                                     cfg.data_parallel_size, t.rampup_batch_size
                                     ).num_microbatches


# ----------------------------------------------------------------------------- recorded


def volume_kind(op: CommOp, kinds: frozenset[str]) -> Optional[str]:
    """Which volume an iteration's operation counts in (None: not per iteration), given the
    kinds of group it went to (``ranks.group_kinds``)."""
    if op.phase != "iteration" or op.op == "new_group":
        return None
    small = op.dtype == "object" or _numel(op.shape) <= SMALL
    if "expert" in kinds and DISPATCH_SITE in op.site:
        return "ep dispatch"
    if "tensor" in kinds:
        if op.op == "all_reduce":
            return "tp all-reduce"
        if op.op.startswith("all_gather"):
            return "tp all-gather"
        if op.op.startswith("reduce_scatter"):
            return "tp reduce-scatter"
    if "pipeline" in kinds and op.is_p2p:
        return "pp send" if op.op == "send" else "pp recv"
    # Gradients and optimizer shards go over data x context ranks under context parallelism;
    # the ring's sends and the all-to-alls of context-parallel attention count as "other".
    if ({"data", "data_context", "expert_data"} & kinds) and not small:
        if op.op == "all_reduce" or op.op.startswith("reduce_scatter"):
            return "dp reduce"
        if op.op.startswith("all_gather"):
            return "dp gather"
    if "embedding" in kinds and op.op == "all_reduce" and not small:
        return "embedding all-reduce"
    return "other"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def recorded_volume(grid: RankGrid, ops: Sequence[CommOp]) -> dict[str, int]:
    groups, kinds, out = grid.groups(), {}, dict.fromkeys(VOLUME_KINDS, 0)
    for op in ops:
        if op.group not in kinds:
            kinds[op.group] = group_kinds(grid, groups, op.group)
        kind = volume_kind(op, kinds[op.group])
        if kind is not None:
            out[kind] += op.nbytes
    return out


# ----------------------------------------------------------------------------- the formula


@dataclasses.dataclass(frozen=True)
class StageParams:
    """What the formula needs from one built stage (tensor rank 0), at one size."""

    parameters: int
    sequence_parallel: int  # parameters whose gradients are summed over the tensor group
    experts: int = 0  # experts of expert parallelism (reduced over the expert-data ranks)


def stage_params(cfg: RunConfig, pp_rank: int) -> StageParams:
    chunks = build_rank_on_meta(cfg, 0, pp_rank)
    params = [p for c in chunks for p in c.parameters()]
    sp = sum(p.numel() for p in params if getattr(p, "sequence_parallel", False))
    return StageParams(sum(p.numel() for p in params), sp,
                       sum(p.numel() for p in params if is_expert(p)))


def _chunks_with_neighbours(cfg: RunConfig, pp_rank: int) -> tuple[int, int]:
    """(chunks of this stage with a next chunk, chunks with a previous chunk)."""
    p = cfg.parallel.pipeline_model_parallel_size
    v = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    if p == 1:
        return 0, 0
    last = 1 if pp_rank == p - 1 else 0
    first = 1 if pp_rank == 0 else 0
    return v - last, v - first


def _recomputed(cfg: RunConfig, flags: list[bool]) -> list[bool]:
    """Which of the stage's layers (``flags``: whether each is a mixture of experts, in
    order) run their forward pass again under --recompute-granularity full."""
    m = cfg.model
    if m.recompute_granularity != "full":
        return []
    if m.recompute_method == "block":
        return flags[:min(m.recompute_num_layers or 1, len(flags))]
    return flags


def comm_volume(cfg: RunConfig, pp_rank: int, stage: StageParams,
                num_microbatches: int) -> dict[str, int]:
    """One rank's payload bytes per iteration by kind (module docstring), without "other"."""
    m, par = cfg.model, cfg.parallel
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    e = bytes_of(m.params_dtype)
    n = num_microbatches
    flags = [moe for chunk in stage_moe_flags(cfg, pp_rank) for moe in chunk]
    again = _recomputed(cfg, flags)
    out = dict.fromkeys(VOLUME_KINDS, 0)
    out.pop("other")
    if t > 1:
        out.update(_tensor_volume(cfg, pp_rank, stage, flags, again, n))
    if p > 1:
        sp = par.sequence_parallel and t > 1
        act = m.seq_length * cfg.training.micro_batch_size * m.hidden_size * e  # s b h e
        sends_next, recvs_prev = _chunks_with_neighbours(cfg, pp_rank)
        boundary = act // (t if sp else 1)
        out["pp send"] = n * boundary * (sends_next + recvs_prev)
        out["pp recv"] = n * boundary * (sends_next + recvs_prev)
        tied = not m.untie_embeddings_and_output_weights
        if tied and pp_rank in (0, p - 1):
            out["embedding all-reduce"] = m.padded_vocab_size // t * m.hidden_size * grad_bytes(cfg)
    out.update(_data_volume(cfg, stage))
    forward, backward = experts.dispatch_bytes_per_layer(cfg)
    out["ep dispatch"] = n * (sum(flags) * (forward + backward) + sum(again) * forward)
    return out


def _tensor_volume(cfg: RunConfig, pp_rank: int, stage: StageParams, flags: list[bool],
                   again: list[bool], n: int) -> dict[str, int]:
    """The tensor group's volume (module docstring): two sublayers per dense layer (attention,
    MLP), one per MoE layer plus its experts' rows and shared expert."""
    m, par = cfg.model, cfg.parallel
    p, sp = par.pipeline_model_parallel_size, par.sequence_parallel
    e = bytes_of(m.params_dtype)
    act = m.seq_length * cfg.training.micro_batch_size * m.hidden_size * e  # s b h e
    tokens = m.seq_length * cfg.training.micro_batch_size
    moe, moe_again = sum(flags), sum(again)
    sublayers = 2 * len(flags) - moe
    units = 2 * sublayers + 2 * len(again) - moe_again  # forward + backward, + recomputed
    first, last = pp_rank == 0, pp_rank == p - 1
    out = {}
    if sp:  # the embedding's sequence split gathers its gradient back on the first stage
        # QKV and FC1 gather their input again in the backward (they keep only its part).
        out["tp all-gather"] = n * act * (units + sublayers + first + last)
        out["tp reduce-scatter"] = n * act * (units + last)
        out["tp all-reduce"] = n * act * first + stage.sequence_parallel * grad_bytes(cfg)
        # An MoE layer gathers the sequence, and its output's gradient.
        out["tp all-gather"] += n * act * (2 * moe + moe_again)
    else:
        out["tp all-reduce"] = n * act * (units + first + last)
    out["tp all-reduce"] += n * 3 * tokens * 4 * last
    if moe:
        rows = experts.sent_and_computed_rows(cfg)[1]
        shared = act if m.moe_shared_expert_intermediate_size is not None else 0
        out["tp all-reduce"] += n * (2 * moe + moe_again) * (rows * m.hidden_size * e + shared)
    return out


def _data_volume(cfg: RunConfig, stage: StageParams) -> dict[str, int]:
    """Gradients reduced (and, distributed optimizer, parameters gathered) over the data-
    parallel ranks; the experts of expert parallelism over their expert-data ranks."""
    dp, ep = cfg.data_parallel_size, cfg.parallel.expert_model_parallel_size
    counted = (stage.parameters - stage.experts if dp > 1 else 0) + \
        (stage.experts if dp // ep > 1 else 0)
    gather = bytes_of(cfg.model.params_dtype) if cfg.optimizer.use_distributed_optimizer else 0
    return {"dp reduce": counted * grad_bytes(cfg), "dp gather": counted * gather}


# ----------------------------------------------------------------------------- the facts


@dataclasses.dataclass(frozen=True)
class RankFacts:
    rank: int
    parameters: int
    memory: dict[str, int]  # planner, real size
    peak: int  # planner's total
    volume: dict[str, int]  # real size


@dataclasses.dataclass(frozen=True)
class CrossCheck:
    """The planner and the formula at the rehearsal's size against what was measured."""

    rank: int
    planned: dict[str, int]
    measured: dict[str, int]


@dataclasses.dataclass(frozen=True)
class LaunchFacts:
    grid: RankGrid
    num_microbatches: int
    per_stage: tuple[RankFacts, ...]  # tensor/data rank 0 of each stage
    fullest: RankFacts
    emptiest: RankFacts
    total_params: int
    checks: tuple[CrossCheck, ...]


def _stage_memory(plan: Plan, pp_rank: int) -> dict[str, int]:
    mem = plan.stages[pp_rank].memory
    return {"weights": mem.weights, "gradients": mem.gradients, "optimizer": mem.optimizer,
            "activations": mem.activations}


def launch_facts(cfg: RunConfig, rehearsed: RunConfig, plan: RankPlan,
                 results: Sequence[RankResult], small_plan: Optional[Plan] = None
                 ) -> LaunchFacts:
    """``cfg``: the run as launched (vocabulary resolved); ``rehearsed``: what the ranks ran
    (``small_plan``: its plan, if made already)."""
    grid, m = plan.grid, iteration_microbatches(rehearsed)
    real_plan, small_plan = build_plan(cfg), small_plan or build_plan(rehearsed)
    by_rank = {r.rank: r for r in results}
    stages, checks = [], []
    for pp_rank in range(grid.pp):
        rank = grid.rank(pp_rank, 0, 0)
        volume = comm_volume(cfg, pp_rank, stage_params(cfg, pp_rank), m)
        result = by_rank.get(rank)
        other = recorded_volume(grid, result.ops)["other"] if result else 0
        volume["other"] = other
        memory = _stage_memory(real_plan, pp_rank)
        stages.append(RankFacts(rank, max(real_plan.stages[pp_rank].params_per_rank), memory,
                                real_plan.stages[pp_rank].memory.total, volume))
        if result is not None:
            planned = _stage_memory(small_plan, pp_rank)
            planned.update(comm_volume(rehearsed, pp_rank, stage_params(rehearsed, pp_rank), m))
            measured = dataclasses.asdict(result.memory)
            recorded = recorded_volume(grid, result.ops)
            measured.update({k: v for k, v in recorded.items() if k != "other"})
            checks.append(CrossCheck(rank, planned, measured))
    fullest = max(stages, key=lambda f: (f.peak, -f.rank))
    emptiest = min(stages, key=lambda f: (f.peak, f.rank))
    return LaunchFacts(grid, m, tuple(stages), fullest, emptiest, real_plan.total_params,
                       tuple(checks))


# ----------------------------------------------------------------------------- the table


def _size(n: float) -> str:
    for unit, scale in (("TB", 2**40), ("GB", GB), ("MB", 2**20), ("KB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def format_facts(facts: LaunchFacts) -> str:
    grid = facts.grid
    full, empty = facts.fullest, facts.emptiest
    width = 30
    head = (f"{'per rank (real size)':<{width}}{'fullest: ' + grid.describe(full.rank):<48}"
            f"emptiest: {grid.describe(empty.rank)}")
    lines = [head, f"{'parameters':<{width}}{_count(full.parameters):<48}"
                   f"{_count(empty.parameters)}"]
    lines.append("memory per GPU (planner)")
    for kind in MEMORY_KINDS:
        lines.append(f"  {kind:<{width - 2}}{_size(full.memory[kind]):<48}"
                     f"{_size(empty.memory[kind])}")
    lines.append(f"  {'total (peak)':<{width - 2}}{_size(full.peak):<48}{_size(empty.peak)}")
    lines.append(f"communication per iteration ({facts.num_microbatches} micro-batches, payload)")
    for kind in VOLUME_KINDS:
        lines.append(f"  {kind:<{width - 2}}{_size(full.volume[kind]):<48}"
                     f"{_size(empty.volume[kind])}")
    lines += _totals(facts)
    return "\n".join(lines)


def _totals(facts: LaunchFacts) -> list[str]:
    grid = facts.grid
    per_stage_ranks = grid.tp * grid.replicas
    memory = sum(f.peak for f in facts.per_stage) * per_stage_ranks
    volume = {k: sum(f.volume[k] for f in facts.per_stage) * per_stage_ranks
              for k in VOLUME_KINDS}
    lines = [f"whole run ({grid.world} GPUs): {_count(facts.total_params)} parameters, "
             f"{_size(memory)} of memory in all (peak {_size(facts.fullest.peak)} per GPU)",
             "  communication per iteration, all ranks: " + ", ".join(
                 f"{k} {_size(v)}" for k, v in volume.items() if v)]
    return lines


def format_cross_checks(facts: LaunchFacts) -> str:
    """Planner/formula at the rehearsal's size over what the rehearsed ranks held and did.
    Activations are shown, not compared: the CPU's attention keeps its s x s scores, softmax
    and dropout mask in fp32, which the planner leaves to a GPU's fused kernel."""
    lines = ["cross-check at the rehearsal's size (planner or formula / measured or recorded):"]
    for check in facts.checks:
        ratios = []
        for kind in ("weights", "gradients", "optimizer", *VOLUME_KINDS[:-1]):
            planned, measured = check.planned.get(kind, 0), check.measured.get(kind, 0)
            if planned or measured:
                ratio = planned / measured if measured else float("inf")
                ratios.append(f"{kind} {ratio:.3f}")
        lines.append(f"  {facts.grid.describe(check.rank)}: " + ", ".join(ratios))
    if facts.checks:
        check = max(facts.checks, key=lambda c: c.measured["activations"])
        lines.append(
            f"  activations ({facts.grid.describe(check.rank)}): planner "
            f"{_size(check.planned['activations'])}, measured {_size(check.measured['activations'])}"
            " (not compared: on the CPU attention keeps its s x s scores, which the planner "
            "leaves to a GPU's fused kernel)")
    return "\n".join(lines)

"""tools/plan.py against the model it plans: parameter counts per rank and in total, and the
memory figure against the peak measured during a training step.

Counts: 4 real gloo ranks (tensor 2 x pipeline 2, then pipeline 4 with 2 virtual chunks per
stage) build their stages as pretrain_gpt.py does and count their parameters; one process
builds the whole model. The planner (meta device)
must give the same numbers, and its closed form the same total.

Memory, measured on the CPU without tracemalloc or RSS (both see Python objects, allocator
caches and libraries, not tensors): the bytes of every tensor storage alive before the step
(parameters, gradient buffers, optimizer state, the kept logits buffer; each storage once),
plus the peak of the running sum of allocations and frees that torch's profiler records with
``profile_memory=True`` during the step (every CPU allocation through c10's allocator, with
its size and time). That is the CPU twin of ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc

import torch

from megatron.config import parse_args
from tests.dist_utils import run_distributed

MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--use-cpu",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
]


def _config(world_size: int, *extra: str):
    cfg = parse_args([*MODEL_FLAGS, *extra], world_size=world_size)
    return cfg.with_vocab_size(cfg.data.vocab_size)


def _context(cfg):
    from megatron.assembly.build import RunContext
    from megatron.core import parallel_state

    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size)
    return RunContext(cfg, device=torch.device("cpu"))


def _count_built(rank: int, world_size: int, layouts: list[tuple[str, ...]]):
    """For each layout, (pipeline rank, tensor rank, parameters) of this rank's stage (all its
    virtual chunks), built as training builds it."""
    from megatron.assembly.build import build_model_chunks
    from megatron.core import parallel_state
    from pretrain_gpt import model_provider

    counts = []
    for extra in layouts:
        chunks = build_model_chunks(model_provider, _context(_config(world_size, *extra)))
        counts.append((parallel_state.get_pipeline_model_parallel_rank(),
                       parallel_state.get_tensor_model_parallel_rank(),
                       sum(p.numel() for c in chunks for p in c.parameters())))
        parallel_state.destroy_model_parallel()
    return counts


TP2_PP2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
# Interleaved 1F1B: 8 layers on 4 stages, 2 chunks of 1 layer each per stage.
PP4_VP2 = ("--pipeline-model-parallel-size", "4", "--num-layers", "8",
           "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1")


def test_planned_counts_equal_the_built_model_per_rank_and_in_total():
    from megatron.planning.planner import build_plan

    per_rank = run_distributed(_count_built, 4, [TP2_PP2, PP4_VP2])
    [[(_, _, whole)]] = run_distributed(_count_built, 1, [()])
    for i, layout in enumerate((TP2_PP2, PP4_VP2)):
        built = [counts[i] for counts in per_rank]
        plan = build_plan(_config(4, *layout))
        planned = {(st.pipeline_rank, tp): n for st in plan.stages
                   for tp, n in enumerate(st.params_per_rank)}
        assert planned == {(pp, tp): n for pp, tp, n in built}, layout
        # The layout is not free: replicated LayerNorms/biases and the tied copy add up.
        assert sum(n for _, _, n in built) > plan.total_params
    assert build_plan(_config(4, *TP2_PP2)).total_params == whole
    one = build_plan(_config(1))
    assert one.stages[0].params_per_rank == (whole,)
    assert one.total_params == whole == one.closed_form_params
    eight = build_plan(_config(4, *PP4_VP2))
    assert eight.total_params == eight.closed_form_params


# Mixtures of experts in layer 0 of 2 (the other dense): 4 GeLU experts of width 48 with
# biases, top-2, and a gated shared expert of width 32.
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
       "--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", "32",
       "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "0.01")
EP2_TP2 = ("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
           "--use-distributed-optimizer")


def _count_built_experts(rank: int, world_size: int, extra: tuple[str, ...]):
    """(tensor rank, parameters, expert-parallel parameters) of this rank, built as training
    builds it, and the names of one expert's parameters with their sizes."""
    from megatron.assembly.build import build_model_chunks
    from megatron.core import parallel_state
    from megatron.core.distributed.distributed_data_parallel import is_expert
    from pretrain_gpt import model_provider

    chunks = build_model_chunks(model_provider, _context(_config(world_size, *extra)))
    params = dict(chunks[0].named_parameters())
    one_expert = {n: p.numel() for n, p in params.items() if ".local_experts.0." in n}
    out = (parallel_state.get_tensor_model_parallel_rank(),
           sum(p.numel() for p in params.values()),
           sum(p.numel() for p in params.values() if is_expert(p)), one_expert)
    parallel_state.destroy_model_parallel()
    return out


def test_planned_expert_counts_equal_the_built_model_in_total_active_and_per_rank():
    """One process builds the whole MoE model: its parameters are the planner's total and
    closed form; the active count is that less the 2 experts of 4 a token skips in the one
    MoE layer (counted by hand, and from the built expert). At tensor 2 x expert 2 (4 gloo
    ranks) each rank holds 2 experts' halves: the planner's per-rank and expert counts."""
    from megatron.planning.planner import build_plan

    [(_, whole, _, one_expert)] = run_distributed(_count_built_experts, 1, MOE)
    h, f_e = 64, 48
    expert = 2 * h * f_e + f_e + h  # FC1 and FC2 with their biases
    assert sum(one_expert.values()) == expert, one_expert
    plan = build_plan(_config(1, *MOE))
    assert plan.total_params == whole == plan.closed_form_params
    assert plan.active_params == whole - (4 - 2) * expert
    built = run_distributed(_count_built_experts, 4, (*MOE, *EP2_TP2))
    split = build_plan(_config(4, *MOE, *EP2_TP2))
    assert split.total_params == whole
    assert split.active_params == plan.active_params
    [stage] = split.stages
    for tp_rank, params, experts, _ in built:
        assert stage.params_per_rank[tp_rank] == params
        # Two experts' halves, each with the whole FC2 bias (row-parallel: replicated).
        assert stage.experts_per_rank[tp_rank] == experts == 2 * ((2 * h * f_e + f_e) // 2 + h)
    # Adam's moments (fp32: no main copy): the experts' over their expert-data ranks (1
    # here), the dense parameters' over data 2.
    experts = stage.experts_per_rank[0]
    dense = stage.params_per_rank[0] - experts
    assert stage.memory.optimizer == 8 * dense // 2 + 8 * experts


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _live_state(chunks, optimizer) -> int:
    from megatron.core.tensor_parallel.cross_entropy import LogitsWorkspace

    tensors = [p for c in chunks for p in c.parameters()]
    tensors += [getattr(p, "main_grad", None) for p in tensors]
    tensors += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    tensors += [b for c in chunks for m in c.modules() for w in vars(m).values()
                if isinstance(w, LogitsWorkspace) for b in w._free]
    return _storage_bytes(tensors)


def _peak_allocated(profiler) -> int:
    """Highest running sum of the CPU allocations and frees the profiler recorded."""
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    peak = running = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def _measure_steps(rank: int, world_size: int, extras: list[tuple[str, ...]]) -> list[int]:
    """The measured peak of a training step for each setting, one after the other."""
    from megatron.core import parallel_state

    peaks = []
    for extra in extras:
        gc.collect()  # the last setting's model is gone before this one is measured
        peaks.append(_measure_step(extra))
        parallel_state.destroy_model_parallel()
    return peaks


def _measure_step(extra: tuple[str, ...]) -> int:
    from torch.profiler import ProfilerActivity, profile

    from megatron.assembly.build import setup_model_and_optimizer
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.training import train_step
    from pretrain_gpt import forward_step, model_provider

    cfg = _config(1, *extra)
    ctx = _context(cfg)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_provider, ctx)
    data = MockGPTDataset(64, cfg.model.seq_length, cfg.model.vocab_size, 0)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.training.micro_batch_size)
    batches = iter(loader)

    def step():
        return train_step(lambda it, model, stage: forward_step(ctx, it, model, stage),
                          batches, chunks, optimizer, scheduler, ctx, cfg.num_microbatches)

    step()  # the optimizer state exists from here on
    before = _live_state(chunks, optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return before + _peak_allocated(prof)


# The recompute settings, and mixtures of experts in every layer (router, experts and the
# gated shared expert: megatron/planning/experts.py's activation terms).
RECOMPUTE_SETTINGS = [(), ("--recompute-granularity", "full", "--recompute-method", "uniform"),
                      (*MOE, "--moe-layer-freq", "1")]


def test_planned_memory_is_within_20_percent_of_the_measured_peak():
    from megatron.planning.planner import build_plan

    [peaks] = run_distributed(_measure_steps, 1, RECOMPUTE_SETTINGS)
    for extra, measured in zip(RECOMPUTE_SETTINGS, peaks):
        plan = build_plan(_config(1, *extra))
        planned, activations = plan.peak_memory, plan.stages[0].memory.activations
        print(f"{' '.join(extra) or 'no recompute'}: planned {planned / 2**20:.2f} MiB "
              f"(activations {activations / 2**20:.2f}), measured {measured / 2**20:.2f} MiB")
        assert activations > 0.25 * planned  # the activation formula carries weight here
        assert abs(planned - measured) <= 0.2 * measured, (extra, planned, measured)

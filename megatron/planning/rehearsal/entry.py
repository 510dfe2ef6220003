"""``pretrain_gpt.py ... --rehearse`` (and ``tools/rehearse.py``): rehearse the launch, print
what was found and the launch facts, and exit: 0 when the ranks' communication fits together,
1 when it does not (or a rank's own code failed), 2 on bad input."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from megatron.assembly.build import build_run_tokenizer, run_vocab_size
from megatron.config import ConfigError, RunConfig
from megatron.planning.planner import Plan, build_plan
from megatron.planning.rehearsal.checker import check
from megatron.planning.rehearsal.facts import (
    format_cross_checks,
    format_facts,
    iteration_microbatches,
    launch_facts,
)
from megatron.planning.rehearsal.ranks import RankGrid, RankPlan, plan_ranks
from megatron.planning.rehearsal.runner import (
    AroundRank,
    RankFailure,
    RankResult,
    StartRank,
    run_planned_ranks,
)
from megatron.planning.rehearsal.setup import check_rehearsable, rehearsal_config
from megatron.tokenizer import TokenizerConfigError

GB = 2**30
# The rehearsal keeps one rank's model at a time; leave the machine some room.
_MEMORY_SHARE = 0.5


def _fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(rehearsed: RunConfig, small_plan: Plan) -> None:
    """The widest rank must fit this machine at the rehearsal's size ("shrunk only where
    memory forces it": the user shrinks with --rehearse-hidden-size when it does not)."""
    available = _available_memory()
    if available is None:
        return
    needed = small_plan.peak_memory
    if needed > available * _MEMORY_SHARE:
        m = rehearsed.model
        _fail(f"one rank of this run needs {needed / GB:.1f} GB at --hidden-size "
              f"{m.hidden_size} and --seq-length {m.seq_length}, more than half of this "
              f"machine's {available / GB:.1f} GB available: give --rehearse-hidden-size (a "
              f"multiple of --num-attention-heads {m.num_attention_heads}) and/or "
              "--rehearse-seq-length", 2)


def _prepare(cfg: RunConfig):
    """(the run's config with its vocabulary, what the ranks run, the tokenizer), or exit 2."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _fail("--rehearse runs every rank in this one process: start it with python (WORLD_SIZE "
              "set to the launch's size), not under torchrun or srun", 2)
    try:
        check_rehearsable(cfg)
        tokenizer = build_run_tokenizer(cfg)
        rehearsed = rehearsal_config(cfg)
    except (ConfigError, TokenizerConfigError) as error:
        _fail(str(error), 2)
    vocab = run_vocab_size(cfg, tokenizer)
    return cfg.with_vocab_size(vocab), rehearsed.with_vocab_size(vocab), tokenizer


def _header(cfg: RunConfig, rehearsed: RunConfig, plan: RankPlan) -> str:
    p, m, r = cfg.parallel, cfg.model, rehearsed.model
    grid = plan.grid
    vp = p.virtual_pipeline_model_parallel_size
    layout = (f"tensor {grid.tp} x pipeline {grid.pp}"
              + (f" x context {grid.cp} ({p.context_attention})" if grid.cp > 1 else "")
              + f" x data {grid.dp} = {grid.world} ranks"
              + (f", {vp} virtual stages" if vp else "")
              + (", sequence parallel" if p.sequence_parallel else "")
              + (f", expert parallel {grid.ep} within data ({m.moe_token_dispatcher_type})"
                 if grid.ep > 1 else "")
              + (", distributed optimizer" if cfg.optimizer.use_distributed_optimizer else ""))
    checked = ", ".join(str(grid.coords(last)[0]) for _, last in sorted(plan.checks))
    who = (f"{len(plan.run)} ranks run (the first rank of each stage, and the last of stages "
           f"{checked} to check that a stage's ranks are alike; the other {plan.derived} issue "
           "their stage's operations in their own groups)"
           if plan.derived else f"all {len(plan.run)} ranks run")
    size = (f"hidden {r.hidden_size} (run: {m.hidden_size}), sequence {r.seq_length} "
            f"(run: {m.seq_length})")
    return "\n".join([
        f"rehearsal over PyTorch's fake process group: {layout}",
        f"  {who}; each: set-up and one iteration of {iteration_microbatches(rehearsed)} "
        f"micro-batches per pipeline, {m.num_layers} layers, {m.num_attention_heads} heads, "
        f"{size}, {str(m.params_dtype).replace('torch.', '')}"])


def rehearse(cfg: RunConfig, start: StartRank, around_rank: Optional[AroundRank] = None) -> int:
    """Run, check and report; returns the exit status. ``start``: each rank's set-up
    (``megatron.training.rank_starter``). ``around_rank``: see
    ``runner.run_planned_ranks`` (tests plant faults with it)."""
    real, rehearsed, tokenizer = _prepare(cfg)
    small_plan = build_plan(rehearsed)
    _check_memory(rehearsed, small_plan)
    p = cfg.parallel
    grid = RankGrid(p.tensor_model_parallel_size, cfg.data_parallel_size,
                    p.pipeline_model_parallel_size, p.context_degree,
                    p.expert_model_parallel_size)
    mode = cfg.training.rehearse_ranks if p.dp_mode == "allreduce" else "all"
    plan = plan_ranks(grid, mode)
    print(_header(real, rehearsed, plan), flush=True)
    began = time.perf_counter()

    def progress(done: int, result: RankResult) -> None:
        if done == len(plan.run) or done % max(1, len(plan.run) // 8) == 0:
            print(f"  {done}/{len(plan.run)} ranks rehearsed ({time.perf_counter() - began:.1f} s)",
                  flush=True)

    try:
        results = run_planned_ranks(rehearsed, tokenizer, start, plan, progress,
                                    around_rank)
    except RankFailure as failure:
        tail = "\n".join(failure.output.strip().splitlines()[-5:])
        print(tail, file=sys.stderr)
        _fail(f"{grid.describe(failure.rank)} failed in its {failure.phase}: {failure} "
              f"(at {failure.site})", 1)
    return report(real, rehearsed, plan, results, small_plan)


def report(real: RunConfig, rehearsed: RunConfig, plan: RankPlan,
           results: list[RankResult], small_plan: Optional[Plan] = None) -> int:
    """Print the checker's findings (or that there are none) and the launch facts."""
    grid = plan.grid
    findings = check(plan, {r.rank: r.ops for r in results},
                     {r.rank: r.unwaited for r in results})
    operations = sum(len(r.ops) for r in results)
    skipped = [r.rank for r in results if r.skipped_step]
    facts = launch_facts(real, rehearsed, plan, results, small_plan)
    print(format_facts(facts))
    print(format_cross_checks(facts))
    guessed = sum(r.objects_not_received for r in results)
    if guessed:
        print(f"note: {guessed} object collective(s) reached a rank before the rank sending "
              "the object was rehearsed; those ranks kept their own objects")
    if skipped:
        print(f"note: the optimizer step was skipped (NaN/Inf or fp16 overflow) on {len(skipped)} "
              "rehearsed rank(s); their update's operations were not rehearsed")
    if findings:
        first = findings[0]
        more = f" ({len(findings) - 1} more finding(s) after it)" if len(findings) > 1 else ""
        print(f"error: the ranks' communication does not fit together{more}:\n{first.text}",
              file=sys.stderr, flush=True)
        return 1
    print(f"rehearsal passed: {operations} operations of {len(results)} rehearsed ranks "
          f"({grid.world} in the launch) fit together: every group's collectives match, every "
          "send has its receive, nothing is left waiting", flush=True)
    return 0


def rehearse_or_exit(cfg: RunConfig, start: StartRank) -> None:
    raise SystemExit(rehearse(cfg, start))

#!/usr/bin/env python
"""Measured pipeline bubble against theory, for 1F1B and interleaved 1F1B.

    python benchmarks/pipeline_bubble.py                          # p = 2, 4; m = 4, 8, 16
    python benchmarks/pipeline_bubble.py --pipeline-sizes 2 --micro-batches 8 --iterations 5

For each pipeline size p it spawns p gloo ranks on this machine; each builds its stage of a
GPT (2 transformer layers per stage: one chunk of 2 layers, or with interleaving v = 2 chunks
of 1) and runs the real schedules (megatron.core.pipeline_parallel.schedules) on random
tokens, one torch thread per rank. Every measured iteration starts after a barrier and times
the schedule call on each stage, with the schedule's own forward/backward/wait timers; the
bubble is ``1 - mean(compute) / max(schedule time)`` (megatron.core.pipeline_parallel.bubble),
the median over iterations.

The shape is compute-bound: a micro-batch's activation ([s, b, h] = 128 x 2 x 512 fp32,
512 KB) crosses loopback in well under a millisecond while each stage computes for tens of
milliseconds; the vocabulary is small so the last stage's LM head adds little to its layers.

Columns: theory ``(p - 1) / (v m + p - 1)``; "expected here": the same schedule played with
the measured per-micro-batch compute times on this machine's cores shared evenly among the
stages computing at once (processor sharing). With p ranks on fewer cores than p, stages that
compute at the same time slow each other down while fill and drain run alone at full speed,
so the measured bubble falls below the ideal theory; "expected here" accounts for that. When
p <= cores the two columns agree. Not a test; a shared machine makes the figures noisy.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO)

from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import bubble, schedules  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.model.stages import layer_range  # noqa: E402
from megatron.timers import Timers  # noqa: E402

LAYERS_PER_STAGE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One rank ---------------------------------------------------------------------------------------


def _forward_step(data_iterator, model):
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    tokens = labels = None
    if first or last:
        sample = next(data_iterator)
        tokens, labels = sample[:, :-1], sample[:, 1:]
    out = model(tokens, labels=labels if last else None)
    return out, lambda o: (o.mean(), {"lm loss": o.mean().detach()})


def _build_chunks(config: ModelConfig, p: int, v: int) -> list:
    stage = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for c in range(v):
        parallel_state.set_virtual_pipeline_model_parallel_rank(c if v > 1 else None)
        first, count = layer_range([LAYERS_PER_STAGE] * p, stage, v if v > 1 else None, c)
        chunks.append(GPTModel(config, pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage(),
                               first_layer=first, num_layers=count))
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if v > 1 else None)
    return chunks


def _data(args, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return iter([torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_length + 1),
                               generator=g) for _ in range(m)])


def _measure(args, p: int, v: int, m: int) -> dict:
    """Median bubble over the measured iterations, and the stages' times of the median one."""
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    config = ModelConfig(num_layers=LAYERS_PER_STAGE * p, hidden_size=args.hidden_size,
                         num_attention_heads=args.hidden_size // 64, seq_length=args.seq_length,
                         vocab_size=args.vocab, make_vocab_size_divisible_by=64,
                         hidden_dropout=0.0, attention_dropout=0.0)
    chunks = _build_chunks(config, p, v)
    schedule = schedules.get_forward_backward_func()
    runs = []
    for it in range(args.warmup + args.iterations):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        timers = Timers(log_level=1)
        dist.barrier()
        timers(bubble.SCHEDULE_TIMER, log_level=1).start()
        schedule(forward_step_func=_forward_step, data_iterator=_data(args, m, it),
                 model=chunks if v > 1 else chunks[0], num_microbatches=m,
                 seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                 timers=timers)
        timers(bubble.SCHEDULE_TIMER).stop()
        stages = bubble.gather_stage_times(bubble.StageTimes.from_timings(timers.pop_all()))
        if it >= args.warmup:
            runs.append(stages)
    runs.sort(key=bubble.measured_bubble_fraction)
    median = runs[len(runs) // 2]
    return {"bubble": bubble.measured_bubble_fraction(median), "stages": median,
            "spread": (bubble.measured_bubble_fraction(runs[0]),
                       bubble.measured_bubble_fraction(runs[-1]))}


def _worker(rank: int, p: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # p ranks share the cores: one thread each
    dist.init_process_group("gloo", rank=rank, world_size=p)
    parallel_state.initialize_model_parallel(1, p)
    results = {}
    for v in args.virtual_sizes:
        for m in args.micro_batches:
            if v > 1 and m % p != 0:
                continue
            torch.manual_seed(0)
            results[(v, m)] = _measure(args, p, v, m)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run_pipeline(args, p: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, p, port, args, queue)) for r in range(p)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=3600)
    for proc in procs:
        proc.join()
    return results


# Processor-sharing expectation ------------------------------------------------------------------


def _programs(p: int, m: int, v: int, stage_costs: list[tuple[float, float]]) -> list[list]:
    """Each stage's sequence of compute items and exchanges, recorded from the real schedule
    (tests/unit/test_pipeline_schedules.py's recording communicator)."""
    from tests.unit import test_pipeline_schedules as recorded

    programs = []
    for stage in range(p):
        f, b = stage_costs[stage]
        programs.append(recorded.record_stage_program(p, m, v, stage, False, f, b))
    return programs


def play_shared(programs: list[list], cores: int) -> float:
    """Bubble of the programs run on ``cores`` shared evenly by the stages computing at
    once; exchanges cost nothing and complete when every partner is posted."""
    from tests.unit.test_pipeline_schedules import _match_keys

    keyed = _match_keys(programs)
    n = len(keyed)
    pos, left = [0] * n, [None] * n  # left: remaining work of the current compute item
    wall_compute, finish = [0.0] * n, [0.0] * n
    posted: set = set()
    now = 0.0
    while True:
        changed = True
        while changed:  # settle exchanges and start compute items
            changed = False
            for r in range(n):
                while pos[r] < len(keyed[r]) and left[r] is None:
                    item = keyed[r][pos[r]]
                    if item[0] == "c":
                        left[r] = item[1]
                        break
                    posted.update((kind, key) for kind, key in item[1])
                    if not all(("recv" if k == "send" else "send", key) in posted
                               for k, key in item[1]):
                        break
                    pos[r] += 1
                    changed = True
                if pos[r] == len(keyed[r]) and finish[r] == 0.0:
                    finish[r] = now
        active = [r for r in range(n) if left[r] is not None]
        if not active:
            break
        rate = min(1.0, cores / len(active))
        dt = min(left[r] for r in active) / rate
        now += dt
        for r in active:
            wall_compute[r] += dt
            left[r] -= dt * rate
            if left[r] <= 1e-12:
                left[r] = None
                pos[r] += 1
    return 1.0 - (sum(wall_compute) / n) / max(finish)


# Report ---------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--virtual-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    print(f"GPT stage: {LAYERS_PER_STAGE} layers, h={args.hidden_size}, s={args.seq_length}, "
          f"b={args.micro_batch_size}, vocab={args.vocab}; 1 torch thread per rank, "
          f"{args.cores} cores; median of {args.iterations} iterations after {args.warmup}")
    print(f"{'p':>2} {'v':>2} {'m':>3} | {'theory':>7} {'expected here':>13} {'measured':>9} "
          f"{'min-max':>13} | measured/theory  per-stage fwd/bwd/wait ms")
    for p in args.pipeline_sizes:
        start = time.perf_counter()
        results = run_pipeline(args, p)
        for (v, m), r in sorted(results.items()):
            theory = bubble.theoretical_bubble_fraction(p, m, v)
            # Per-micro-batch compute of each stage (all chunks), from the measured times.
            costs = [(s.forward / m, s.backward / m) for s in r["stages"]]
            expected = play_shared(_programs(p, m, v, costs), args.cores)
            lo, hi = r["spread"]
            stages = " ".join(f"{1e3 * s.forward:.0f}/{1e3 * s.backward:.0f}/{1e3 * s.wait:.0f}"
                              for s in r["stages"])
            print(f"{p:>2} {v:>2} {m:>3} | {100 * theory:6.1f}% {100 * expected:12.1f}% "
                  f"{100 * r['bubble']:8.1f}% {100 * lo:5.1f}-{100 * hi:5.1f}% | "
                  f"{r['bubble'] / theory:5.2f}  {stages}")
        print(f"   (p={p}: {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

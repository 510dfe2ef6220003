#!/usr/bin/env python
"""Measured pipeline bubble against theory, for 1F1B and interleaved 1F1B.

    python benchmarks/pipeline_bubble.py              # p = 2, 4; m = 4, 8, 16 (about 6 min)
    python benchmarks/pipeline_bubble.py --compute sleep --iterations 5

For each pipeline size p it spawns p gloo ranks on this machine and runs the real schedules
(megatron.core.pipeline_parallel.schedules) and point-to-point layer on two kinds of stage:

- ``gpt``: a GPT stage of 2 transformer layers (one chunk of 2, or with interleaving v = 2
  chunks of 1) on random tokens, one torch thread per rank. Compute-bound: a micro-batch's
  activation ([s, b, h] = 128 x 2 x 512 fp32, 512 KB) crosses loopback in a few
  milliseconds while a stage computes for a few hundred; the vocabulary is small so the
  last stage's LM head adds little.
- ``sleep``: stages whose forward and backward sleep for fixed times (1 : 2) and pass small
  [s, b, 16] activations and gradients through the same point-to-point layer. They use no
  CPU, so p ranks do not compete for the cores: this isolates the schedule from the
  machine's compute noise.

The time one activation takes between two stages is measured first and printed: gloo over
this machine's loopback moves about 130 MB/s, so a 512 KB activation costs milliseconds.

Every measured iteration starts after a barrier and times the schedule call on each stage,
with the schedule's own forward/backward/wait timers; the bubble is
``1 - mean(compute) / max(schedule time)`` (megatron.core.pipeline_parallel.bubble), the
median over iterations.

Columns: theory ``(p - 1) / (v m + p - 1)``; "expected here": the same schedule played with
each stage's measured mean compute per micro-batch, on this machine's cores shared evenly
among the stages computing at once (processor sharing; for sleeping stages, no sharing). With
p ranks on fewer cores than p, stages that compute at the same time slow each other down while
fill and drain run alone at full speed, so the bubble falls below the ideal theory; unequal
stages raise it. What neither column has is jitter: on a shared machine a stage that is
descheduled for a moment stalls its neighbours, which shows as extra bubble, most visibly when
the theoretical bubble is small (large m). Not a test.
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
from torch import nn

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO)

from megatron.assembly.build import build_gpt_chunk  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import bubble, schedules  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.timers import Timers  # noqa: E402
from megatron.model.placement import pipeline_chunks  # noqa: E402

LAYERS_PER_STAGE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One rank ---------------------------------------------------------------------------------------


def _gpt_forward_step(data_iterator, model):
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    tokens = labels = None
    if first or last:
        sample = next(data_iterator)
        tokens, labels = sample[:, :-1], sample[:, 1:]
    out = model(tokens, labels=labels if last else None)
    return out, lambda o: (o.mean(), {"lm loss": o.mean().detach()})


def _gpt_chunks(args, p: int, v: int) -> list[nn.Module]:
    config = ModelConfig(num_layers=LAYERS_PER_STAGE * p, hidden_size=args.hidden_size,
                         num_attention_heads=args.hidden_size // 64, seq_length=args.seq_length,
                         vocab_size=args.vocab, make_vocab_size_divisible_by=64,
                         hidden_dropout=0.0, attention_dropout=0.0)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    placed = pipeline_chunks(LAYERS_PER_STAGE * p, p, v if v > 1 else None)[stage]
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if v > 1 else None)
    return [build_gpt_chunk(config, chunk) for chunk in placed]


def _gpt_data(args, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return iter([torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_length + 1),
                               generator=g) for _ in range(m)])


class _Sleep(torch.autograd.Function):
    """Identity that sleeps in forward and in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepChunk(nn.Module):
    """A stand-in stage: ``x * w``, sleeping a fixed time forward and backward."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.times = (forward_s, backward_s)
        self.input_tensor = None

    def set_input_tensor(self, x) -> None:
        self.input_tensor = x

    def forward(self, data):
        x = data if self.input_tensor is None else self.input_tensor
        return _Sleep.apply(x * self.w, *self.times)


def _sleep_forward_step(data_iterator, model):
    data = next(data_iterator) if parallel_state.is_pipeline_first_stage() else None
    out = model(data)
    return out, lambda o: (o.mean(), {"lm loss": o.mean().detach()})


def _sleep_chunks(args, p: int, v: int) -> list[nn.Module]:
    per_chunk = args.sleep_ms / 1000.0 / v  # forward + backward of one micro-batch
    return [SleepChunk(per_chunk / 3, 2 * per_chunk / 3) for _ in range(v)]


def _shape(args, kind: str) -> tuple[int, int, int]:
    hidden = args.hidden_size if kind == "gpt" else args.sleep_hidden_size
    return (args.seq_length, args.micro_batch_size, hidden)


def _sleep_data(args, m: int, seed: int):
    return iter([torch.ones(_shape(args, "sleep")) for _ in range(m)])


KINDS = {  # compute -> (chunk builder, forward step, data)
    "gpt": (_gpt_chunks, _gpt_forward_step, _gpt_data),
    "sleep": (_sleep_chunks, _sleep_forward_step, _sleep_data),
}


def _measure(args, kind: str, p: int, v: int, m: int) -> dict:
    """Median bubble over the measured iterations, and the stages' times of the median one."""
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    build, forward_step, data = KINDS[kind]
    chunks = build(args, p, v)
    schedule = schedules.get_forward_backward_func()
    runs = []
    for it in range(args.warmup + args.iterations):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        timers = Timers(log_level=1)
        dist.barrier()
        timers(bubble.SCHEDULE_TIMER, log_level=1).start()
        schedule(forward_step_func=forward_step, data_iterator=data(args, m, it),
                 model=chunks if v > 1 else chunks[0], num_microbatches=m,
                 seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                 timers=timers, tensor_shape=_shape(args, kind), dtype=torch.float32)
        timers(bubble.SCHEDULE_TIMER).stop()
        stages = bubble.gather_stage_times(bubble.StageTimes.from_timings(timers.pop_all()))
        if it >= args.warmup:
            runs.append(stages)
    runs.sort(key=bubble.measured_bubble_fraction)
    median = runs[len(runs) // 2]
    return {"bubble": bubble.measured_bubble_fraction(median), "stages": median,
            "spread": (bubble.measured_bubble_fraction(runs[0]),
                       bubble.measured_bubble_fraction(runs[-1]))}


def _one_way_ms(shape: tuple[int, ...], repeats: int = 20) -> float:
    """Median one-way time of one activation between stages 0 and 1 (half a round trip)."""
    comm = P2PCommunicator(shape, torch.float32, torch.device("cpu"))
    x = torch.zeros(shape)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if comm.stage == 0:
            comm.exchange(send_next=x)
            comm.exchange(recv_next=True)
        elif comm.stage == 1:
            comm.exchange(recv_prev=True)
            comm.exchange(send_prev=x)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2] / 2


def _worker(rank: int, p: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # p ranks share the cores: one thread each
    dist.init_process_group("gloo", rank=rank, world_size=p)
    parallel_state.initialize_model_parallel(1, p)
    results = {}
    for kind in args.compute:
        results[(kind, "one-way ms")] = _one_way_ms(_shape(args, kind))
        for v in args.virtual_sizes:
            for m in args.micro_batches:
                if v > 1 and m % p != 0:
                    continue
                torch.manual_seed(0)
                results[(kind, v, m)] = _measure(args, kind, p, v, m)
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
                    before = len(posted)
                    posted.update((kind, key) for kind, key in item[1])
                    changed |= len(posted) > before
                    if not all(("recv" if k == "send" else "send", key) in posted
                               for k, key in item[1]):
                        break
                    pos[r] += 1
                    changed = True
                if pos[r] == len(keyed[r]) and finish[r] == 0.0:
                    finish[r] = now
        active = [r for r in range(n) if left[r] is not None]
        if not active:
            if any(pos[r] < len(keyed[r]) for r in range(n)):
                raise RuntimeError("the recorded programs deadlock")
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


def _report(args, kind: str, p: int, results: dict) -> None:
    cores = p if kind == "sleep" else args.cores  # sleeping stages share no cores
    shape = "x".join(map(str, _shape(args, kind)))
    print(f"{kind:>5} {p:>2}: one [s, b, h] = {shape} fp32 activation between stages takes "
          f"{results[(kind, 'one-way ms')]:.2f} ms one way")
    for key, r in sorted((k, r) for k, r in results.items() if k[1] != "one-way ms"):
        k, v, m = key
        if k != kind:
            continue
        theory = bubble.theoretical_bubble_fraction(p, m, v)
        # Each stage's compute per micro-batch (all its chunks), from the measured times.
        costs = [(s.forward / m, s.backward / m) for s in r["stages"]]
        expected = play_shared(_programs(p, m, v, costs), cores)
        lo, hi = r["spread"]
        stages = " ".join(f"{1e3 * s.forward:.0f}/{1e3 * s.backward:.0f}/{1e3 * s.wait:.0f}"
                          for s in r["stages"])
        print(f"{kind:>5} {p:>2} {v:>2} {m:>3} | {100 * theory:6.1f}% {100 * expected:12.1f}% "
              f"{100 * r['bubble']:8.1f}% {100 * lo:5.1f}-{100 * hi:5.1f}% | "
              f"{r['bubble'] / theory:5.2f}  {stages}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--virtual-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--compute", nargs="+", choices=sorted(KINDS), default=["sleep", "gpt"])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--sleep-ms", type=float, default=150.0,
                        help="forward + backward of one micro-batch on a sleeping stage")
    parser.add_argument("--sleep-hidden-size", type=int, default=16,
                        help="h of the activations sleeping stages pass (small: cheap to send)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    print(f"gpt stage: {LAYERS_PER_STAGE} layers, h={args.hidden_size}, s={args.seq_length}, "
          f"b={args.micro_batch_size}, vocab={args.vocab}, 1 torch thread per rank, "
          f"{args.cores} cores; sleep stage: {args.sleep_ms:.0f} ms per micro-batch, "
          f"h={args.sleep_hidden_size}; median "
          f"of {args.iterations} iterations after {args.warmup}")
    print(f"{'kind':>5} {'p':>2} {'v':>2} {'m':>3} | {'theory':>7} {'expected here':>13} "
          f"{'measured':>9} {'min-max':>13} | measured/theory  per-stage fwd/bwd/wait ms")
    for p in args.pipeline_sizes:
        start = time.perf_counter()
        results = run_pipeline(args, p)
        for kind in args.compute:
            _report(args, kind, p, results)
        print(f"   (p={p}: {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

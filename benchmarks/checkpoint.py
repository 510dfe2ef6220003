#!/usr/bin/env python
"""What a checkpoint save costs the training loop: each rank's peak host memory during a save,
and how long the loop stands still per save (issue 23).

    python benchmarks/checkpoint.py                            # ~350M GPT, dp 2, CPU: torch,
                                                               # torch-async
    python benchmarks/checkpoint.py --tree /path/to/main --modes torch    # main's code
    python benchmarks/checkpoint.py --modes torch_dist,torch_dist-async   # once it exists
    python benchmarks/checkpoint.py --num-layers 12 --hidden-size 768 --heads 12 --dp 2

Each mode runs ``pretrain_gpt.py`` (``--mock-data``, fp32, ``--use-distributed-optimizer``,
``--log-interval 1``) on ``--dp`` CPU ranks over gloo, started directly with RANK/WORLD_SIZE so
that this script can sample each rank's resident memory (``/proc/PID/status`` VmRSS, every
10 ms). The run saves every ``--save-at`` iterations, ``--saves`` times, and trains ``--iters-after``
more iterations; each of those saves is measured (--async-save allocates its host buffers in
the background after the run's first iteration and keeps them, so every save copies into
mapped memory, and a --async-save mode's "own" includes those buffers). Modes: ``torch`` (Megatron's folder, saved synchronously),
``torch-async`` (the same with ``--async-save``), ``torch_dist`` / ``torch_dist-async``
(``--ckpt-format torch_dist``: a slot, reported as unavailable where the tree refuses the
flag). ``--tree DIR`` runs DIR's ``pretrain_gpt.py`` with DIR first on PYTHONPATH: pass a
checkout of the code before issue 23 (e.g. ``git worktree add /tmp/before main``) for the
"before" figures, whose every rank gathered the whole optimizer state to save it.

Figures per mode (each from the same run):

- step: the median time of an iteration without a save (the log's elapsed time per iteration)
- stopped: how long the loop stood still for the save, on rank 0's clock (the time each line
  of its output arrived): from the log line of the iteration saved to the "successfully
  saved" line, or with --async-save to the "copied to host memory" line (after which
  training goes on); it includes waiting for the previous background write, if any, and
  for the slowest rank to reach the save; with --async-save the save call's own time, as
  rank 0 logs it, is given too
- write: from the "saving checkpoint" line to the "successfully saved" line (the save's
  publication; for --async-save it runs beside training)
- slower steps: for --async-save, the median step while the write ran, over the median step
- own: each rank's largest resident memory while it trained before the first save (its
  model, gradients and optimizer shard); peak: its largest from the save's start to its
  publication; overhead = peak / own - 1

Goals (issue 23): no rank above its own shard plus 10% during a save; with --async-save the
loop stops for at most 10% of the synchronous save's time. It is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MEMORY_GOAL = 0.10  # peak at most 10% over the rank's own footprint
STOP_GOAL = 0.10  # --async-save stops the loop at most 10% of the synchronous save's time
_ITERATION = re.compile(r" iteration +(\d+)/ *\d+ \| .*?elapsed time per iteration \(ms\): "
                        r"([\d.]+)")
_SAVING = re.compile(r"saving checkpoint at iteration +(\d+)")
_SAVED = re.compile(r"successfully saved checkpoint at iteration +(\d+)")
_COPIED = re.compile(r"checkpoint of iteration +(\d+) copied to host memory in ([\d.]+) s")


@dataclasses.dataclass
class Result:
    mode: str
    available: bool = True
    why: str = ""
    step_s: float = 0.0
    stopped_s: float = 0.0
    write_s: float = 0.0
    copy_s: Optional[float] = None  # --async-save: the save call, timed by rank 0 itself
    slower_steps: Optional[float] = None
    own_mb: list[float] = dataclasses.field(default_factory=list)
    peak_mb: list[float] = dataclasses.field(default_factory=list)
    checkpoint_mb: float = 0.0

    @property
    def overhead(self) -> list[float]:
        return [p / o - 1.0 for p, o in zip(self.peak_mb, self.own_mb)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="torch,torch-async",
                   help="comma-separated: torch, torch-async, torch_dist, torch_dist-async")
    p.add_argument("--tree", default=REPO, help="the code to run (default: this checkout)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (CPU processes)")
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=64,
                   help="short: the save is measured, not the step")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--save-at", type=int, default=6,
                   help="--save-interval (keep --iters-after below it)")
    p.add_argument("--saves", type=int, default=2, help="saves measured")
    p.add_argument("--iters-after", type=int, default=5,
                   help="iterations after the last save (its background write should end "
                   "within them)")
    p.add_argument("--save-dir", default=None,
                   help="where checkpoints go (default: a temporary folder, removed after)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def pretrain_argv(args: argparse.Namespace, mode: str, save: str) -> list[str]:
    argv = [
        os.path.join(args.tree, "pretrain_gpt.py"), "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(max(args.seq_length, 1024)),
        "--micro-batch-size", "1", "--global-batch-size", str(args.dp),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
        "--train-iters", str(args.save_at * args.saves + args.iters_after),
        "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0", "--use-cpu", "--use-distributed-optimizer",
        "--save", save, "--save-interval", str(args.save_at),
    ]
    if mode.startswith("torch_dist"):
        argv += ["--ckpt-format", "torch_dist"]
    if mode.endswith("-async"):
        argv += ["--async-save"]
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Sampler(threading.Thread):
    """Every rank's resident memory every 10 ms, as (time, [MB per rank])."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.samples, self.done = pids, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.monotonic(), [_rss_mb(p) or 0.0 for p in self.pids]))
            time.sleep(0.01)

    def peak(self, start: float, end: float) -> list[float]:
        window = [mb for t, mb in self.samples if start <= t <= end]
        return [max(col) for col in zip(*window)] if window else []


class _LineClock(threading.Thread):
    """Rank 0's output, each line with the time it arrived."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []

    def run(self) -> None:
        for line in self.stream:
            self.lines.append((time.monotonic(), line))

    def first(self, pattern: re.Pattern, iteration: int) -> Optional[float]:
        for t, line in self.lines:
            m = pattern.search(line)
            if m and int(m.group(1)) == iteration:
                return t
        return None


def run_mode(args: argparse.Namespace, mode: str, root: str) -> list[Result]:
    save = os.path.join(root, mode)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(args.dp), LOCAL_WORLD_SIZE=str(args.dp),
               PYTHONPATH=os.pathsep.join([args.tree, env.get("PYTHONPATH", "")]))
    procs = []
    for rank in range(args.dp):
        procs.append(subprocess.Popen(
            [sys.executable, *pretrain_argv(args, mode, save)], cwd=args.tree,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    sampler, clock = _Sampler([p.pid for p in procs]), _LineClock(procs[0].stdout)
    sampler.start()
    clock.start()
    try:
        for p in procs[1:]:
            p.communicate()
        procs[0].wait()
        clock.join()
    finally:
        sampler.done.set()
        for p in procs:  # a failed or interrupted run leaves no rank behind
            if p.poll() is None:
                p.kill()
    log = "".join(line for _, line in clock.lines)
    if any(p.returncode != 0 for p in procs):
        if "torch_dist" in mode and "ckpt-format" in log:
            return [Result(mode, available=False, why="--ckpt-format torch_dist is refused "
                           f"by {args.tree}")]
        raise RuntimeError(f"{mode}: a rank failed:\n{log[-4000:]}")
    return _figures(args, mode, log, clock, sampler, save)


def _figures(args, mode: str, log: str, clock: _LineClock, sampler: _Sampler,
             save: str) -> list[Result]:
    elapsed = {int(m.group(1)): float(m.group(2)) / 1000 for m in _ITERATION.finditer(log)}
    ends = _iteration_times(clock)
    saves = [args.save_at * (i + 1) for i in range(args.saves)]
    windows = {}
    for k in saves:
        start, published = clock.first(_SAVING, k), clock.first(_SAVED, k)
        if start is None or published is None:
            raise RuntimeError(f"{mode}: no save of iteration {k} in the log:\n{log[-3000:]}")
        windows[k] = (start, published)
    busy = {it for it, t in ends.items() for a, b in windows.values() if a - 1e-3 < t < b}
    last = args.save_at * args.saves + args.iters_after
    quiet = [elapsed[it] for it in elapsed
             if it > 2 and it - 1 not in saves and it not in busy and it < last]
    step = statistics.median(quiet) if quiet else statistics.median(elapsed.values())
    own = sampler.peak(ends.get(2, windows[saves[0]][0] - 1.0), windows[saves[0]][0])
    results = []
    for n, k in enumerate(saves, 1):
        start, published = windows[k]
        resumed = clock.first(_COPIED, k) if mode.endswith("-async") else published
        if resumed is None:
            raise RuntimeError(f"{mode}: no 'copied to host memory' line for iteration {k}")
        result = Result(f"{mode} #{n}", step_s=step, stopped_s=resumed - ends[k],
                        write_s=published - start, own_mb=own,
                        peak_mb=sampler.peak(start, published),
                        checkpoint_mb=_folder_mb(os.path.join(save, f"iter_{k:07d}")))
        during = [elapsed[it] for it, t in ends.items() if start < t < published and it > k + 1]
        if mode.endswith("-async") and during:
            result.slower_steps = statistics.median(during) / step
        if mode.endswith("-async"):
            result.copy_s = float(_COPIED.search(
                next(line for t, line in clock.lines if t == resumed)).group(2))
        results.append(result)
    return results


_ITERATION_ANY = re.compile(r" iteration +(\d+)/")


def _iteration_times(clock: _LineClock) -> dict[int, float]:
    out = {}
    for t, line in clock.lines:
        m = _ITERATION_ANY.match(line)
        if m:
            out[int(m.group(1))] = t
    return out


def _folder_mb(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder)
               for n in names) / 2**20


def report(results: list[Result], args: argparse.Namespace) -> str:
    lines = [f"checkpoint save cost: {args.num_layers} layers x {args.hidden_size} hidden, "
             f"vocab {args.vocab_size}, seq {args.seq_length}, dp {args.dp}, fp32, CPU, "
             f"--use-distributed-optimizer; code: {args.tree}",
             f"{'mode':18} {'ckpt MB':>8} {'step s':>7} {'stopped s':>9} {'write s':>8} "
             f"{'own MB per rank':>20} {'peak MB per rank':>20} {'overhead':>16}"]
    sync = {r.mode: r for r in results if r.available and "-async" not in r.mode}
    for r in results:
        if not r.available:
            lines.append(f"{r.mode:18} not measured: {r.why}")
            continue
        over = " ".join(f"{o:+.1%}" for o in r.overhead)
        lines.append(f"{r.mode:18} {r.checkpoint_mb:8.0f} {r.step_s:7.2f} {r.stopped_s:9.2f} "
                     f"{r.write_s:8.2f} {' '.join(f'{m:.0f}' for m in r.own_mb):>20} "
                     f"{' '.join(f'{m:.0f}' for m in r.peak_mb):>20} {over:>16}")
    for r in results:
        if not r.available:
            continue
        ok = all(o <= MEMORY_GOAL for o in r.overhead)
        lines.append(f"  {r.mode}: memory goal (peak <= own + {MEMORY_GOAL:.0%}) "
                     f"{'met' if ok else 'NOT met'}")
        base = sync.get(r.mode.replace("-async", "")) if "-async" in r.mode else None
        if base is not None and base.stopped_s > 0:
            share = r.stopped_s / base.stopped_s
            lines.append(f"  {r.mode}: stops the loop {share:.1%} of {base.mode}'s time "
                         f"(goal <= {STOP_GOAL:.0%}: {'met' if share <= STOP_GOAL else 'NOT met'})"
                         f"; the save call itself took {r.copy_s:.2f} s on rank 0 "
                         f"({r.copy_s / base.stopped_s:.1%})"
                         + (f"; steps while writing {r.slower_steps:.2f}x the quiet median"
                            if r.slower_steps else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.tree = os.path.abspath(args.tree)
    root = args.save_dir or tempfile.mkdtemp(prefix="checkpoint-benchmark-")
    try:
        results = [r for mode in args.modes.split(",") for r in run_mode(args, mode.strip(), root)]
    finally:
        if args.save_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The whole GPU check in one command (issue 21): what to run first whenever a GPU is lent.

Here, beside ../shared, before the GPU call (copies what the GPU machine lacks into the
git-ignored folder gpu-check-inputs/, which the call carries):

    python benchmarks/gpu_check.py --prepare

On the GPU machine, from the checkout's root, nothing installed (the source tree on PYTHONPATH):

    PYTHONPATH=. python benchmarks/gpu_check.py
    PYTHONPATH=. python benchmarks/gpu_check.py --steps smoke throughput-1.3b   # re-measure
    PYTHONPATH=. python benchmarks/gpu_check.py --skip cpu-tests --limit throughput-1.3b=200

Anywhere, without a GPU (what CI runs: every step's plumbing at tiny shapes on the CPU):

    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run

The steps, in order, each in its own process under its own time limit (``STEPS``: planned
seconds on one H100 and the limit; a step past its limit is stopped with everything it
started, recorded as timed out, and the next step runs; no step starts after ``--deadline``;
``--dry-run`` allows three times both, as it checks the plumbing, not the budget):

- ``env``: device, driver, torch, CUDA and package versions, the commit, a bf16 matmul peak;
- ``gpu-tests``: ``pytest -m gpu tests/gpu``;
- ``cpu-tests``: the CPU-suite tests that exercise CUDA paths when a GPU is visible (the
  SIGTERM and pipeline-layout tests that failed on a GPU before, and a few more);
- ``smoke``: WikiText through ``tools/preprocess_data.py``, then ``pretrain_gpt.py`` at the
  GPT-2 124M shape in bf16 for 30 iterations: the loss falls; a run that stops with a
  checkpoint at 15 and its resume reproduce iterations 1-15 and 16-30 exactly; with
  ``--use-flash-attn`` (no flash_attn package there) the same losses;
- ``generate``: ``benchmarks/generate.py --device cuda`` at the GPT-2 124M shape, batch 1 and 8
  (before the throughput steps: it is short, and they are the ones that may overrun);
- ``llama-1b``: ``pretrain_gpt.py`` with the Llama family's options (RMSNorm, SwiGLU, 8 of 32
  heads' key/value groups, RoPE, untied) at Llama 3.2 1B's shape in bf16, sequence 2048,
  12 iterations: finite losses, tokens/s and MFU after 3;
- ``moe``: the same options with 8 experts (top-2, SwiGLU, ``--moe-grouped-gemm``, the
  load-balancing loss on) at 12 layers of hidden 768, sequence 1024: finite losses, tokens/s
  and MFU counting the active experts' FLOPs;
- ``throughput-124m``, ``throughput-350m``, ``throughput-1.3b``:
  ``benchmarks/train_throughput.py --device cuda`` at one shape each (ours eager and
  ``--compile``, nanoGPT eager and compiled, HF), MFU against the ``env`` step's peak.

It installs nothing, and nothing it runs needs deepspeed or nltk. Output, in ``$OUT`` when set,
else ``gpu-check-results/``: ``gpu-check.log`` (every step's output), ``gpu-check.json``
(every figure and check) and ``gpu-check-summary.md`` (the tables, also printed last), all
rewritten after each step, so a run stopped from outside still leaves what it did. Work files
(datasets, checkpoints) go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
INPUTS = REPO / "gpu-check-inputs"
RESULTS = REPO / "gpu-check-results"
SHARED = REPO.parent / "shared"
LOG, FIGURES, SUMMARY = "gpu-check.log", "gpu-check.json", "gpu-check-summary.md"
# What the GPU machine needs from ../shared, under the same relative paths in gpu-check-inputs/.
INPUT_FILES = ("data/gpt2/gpt2-vocab.json", "data/gpt2/gpt2-merges.txt",
               "data/wikitext-2/valid.txt", "data/wikitext-2/test.txt",
               "peers/nanogpt/model.py", "peers/nanogpt/LICENSE")


@dataclass(frozen=True)
class Step:
    name: str
    planned_s: float  # what it should take on one H100
    limit_s: float  # where it is stopped
    what: str


STEPS = (
    Step("env", 20, 45, "device, driver, versions, bf16 matmul peak"),
    Step("gpu-tests", 60, 120, "pytest -m gpu tests/gpu"),
    Step("cpu-tests", 60, 120, "CPU-suite tests that exercise CUDA paths"),
    Step("smoke", 60, 120, "pretrain_gpt.py bf16 124M on WikiText: falls, exact resume, "
                           "--use-flash-attn fallback"),
    Step("generate", 30, 60, "benchmarks/generate.py: KV-cached generation against HF"),
    Step("llama-1b", 45, 90, "pretrain_gpt.py bf16 at Llama 3.2 1B's shape: tokens/s, MFU"),
    Step("moe", 30, 75, "pretrain_gpt.py bf16, 8 experts top-2, grouped GEMM: tokens/s, MFU"),
    Step("throughput-124m", 70, 130, "train_throughput.py at GPT-2 124M, 5 contenders"),
    Step("throughput-350m", 70, 140, "train_throughput.py at GPT-2 350M, 5 contenders"),
    Step("throughput-1.3b", 85, 150, "train_throughput.py at 1.3B, 5 contenders"),
)
STEP_NAMES = tuple(s.name for s in STEPS)
DEADLINE_S = 540.0  # no step starts after this, and each is cut off there
MIN_START_S = 10.0  # a step with less than this left before the deadline is not started
# --dry-run checks plumbing, not the GPU budget, on CPUs that may be shared and slow: its
# limits and deadline are this many times the GPU ones.
DRY_RUN_SLACK = 3.0


# Preparation (here, beside ../shared) ------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expected_sums(shared: Path) -> dict[str, str]:
    """``data/...`` path -> SHA-256 from ../shared/data/SHA256SUMS (empty where there is none)."""
    sums = shared / "data" / "SHA256SUMS"
    if not sums.is_file():
        return {}
    pairs = (line.split() for line in sums.read_text().splitlines() if line.strip())
    return {f"data/{name}": digest for digest, name in pairs}


def prepare(shared: Path, dest: Path) -> int:
    """Copy ``INPUT_FILES`` from ``shared`` into ``dest`` (each written whole, checked against
    SHA256SUMS where listed) and record the commit; 0, or 2 with ``error:`` lines."""
    missing = [rel for rel in INPUT_FILES if not (shared / rel).is_file()]
    if missing:
        for rel in missing:
            print(f"error: {shared / rel}: not found (--shared names the folder that holds "
                  "data/ and peers/)", file=sys.stderr)
        return 2
    sums, files = expected_sums(shared), {}
    for rel in INPUT_FILES:
        digest = sha256(shared / rel)
        if rel in sums and sums[rel] != digest:
            print(f"error: {shared / rel}: SHA-256 differs from {shared}/data/SHA256SUMS",
                  file=sys.stderr)
            return 2
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared / rel, target.with_name(target.name + ".tmp"))
        os.replace(target.with_name(target.name + ".tmp"), target)
        files[rel] = digest
    from gpu_check_steps import commit_info  # beside this file

    record = {**commit_info(REPO), "prepared": datetime.datetime.now().isoformat(timespec="seconds"),
              "files": files}
    (dest / "prepared.json").write_text(json.dumps(record, indent=1) + "\n")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"prepared {dest} ({size / 2**20:.1f} MiB, {len(files)} files; commit "
          f"{record['commit']}{' with uncommitted changes' if record['dirty'] else ''})")
    return 0


# Running the steps (the parent) --------------------------------------------------------------


@dataclass
class StepResult:
    name: str
    status: str  # passed, failed, timed out, not run
    wall_s: Optional[float] = None
    limit_s: Optional[float] = None
    planned_s: Optional[float] = None
    note: str = ""
    checks: list = dataclasses.field(default_factory=list)  # [name, ok, detail]
    figures: dict = dataclasses.field(default_factory=dict)


def child_env(inputs: Path) -> dict[str, str]:
    """The environment of every step: the source tree first on PYTHONPATH (nothing is
    installed there), the prepared test data and nanoGPT where they are, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # The GPU machine reaches no network: nothing may wait on the Hugging Face hub.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if (inputs / "data" / "gpt2" / "gpt2-vocab.json").is_file():
        env.setdefault("MEGATRON_TEST_DATA", str(inputs / "data"))
    if (inputs / "peers" / "nanogpt" / "model.py").is_file():
        env.setdefault("NANOGPT_MODEL", str(inputs / "peers" / "nanogpt" / "model.py"))
    return env


def worker_command(step: str, args: argparse.Namespace, work: Path,
                   peak_tflops: Optional[float]) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", step,
               "--work", str(work), "--inputs", str(args.inputs)]
    if args.dry_run:
        command.append("--dry-run")
    if peak_tflops:
        command += ["--peak-tflops", repr(peak_tflops)]
    return command


def run_step(step: Step, limit: float, args, work: Path, log, peak: Optional[float]):
    """One step in its own process (and process group) under ``limit`` seconds; its output
    goes to ``log``, its figures come back through ``work/STEP.json``."""
    from time_limit import run_with_time_limit  # beside this file

    header = f"\n===== {step.name}: {step.what} (limit {limit:.0f} s) ====="
    print(header, file=log, flush=True)
    start = time.monotonic()
    status = run_with_time_limit(worker_command(step.name, args, work, peak), limit,
                                 stdout=log, cwd=str(REPO), env=child_env(args.inputs))
    wall = time.monotonic() - start
    result = StepResult(step.name, "timed out", wall, limit, step.planned_s)
    report, partial = work / f"{step.name}.json", work / f"{step.name}.figures.json"
    if report.is_file():
        found = json.loads(report.read_text())
        result.checks, result.figures = found["checks"], found["figures"]
    elif partial.is_file():  # a step stopped part way: the figures it had written so far
        result.figures = {**json.loads(partial.read_text()), "partial": True}
    if status is None:
        result.note = f"stopped at its limit of {limit:.0f} s"
    elif status != 0 or not report.is_file():
        result.status, result.note = "failed", f"exit status {status}"
    else:
        result.status = "passed" if all(ok for _, ok, _ in result.checks) else "failed"
    print(f"===== {step.name}: {result.status} in {wall:.1f} s {result.note}", file=log,
          flush=True)
    return result


def chosen_steps(args) -> list[Step]:
    names = set(args.steps or STEP_NAMES) - set(args.skip or ())
    return [s for s in STEPS if s.name in names]


def slack(args) -> float:
    return DRY_RUN_SLACK if args.dry_run else 1.0


def step_limit(step: Step, args, left: float) -> float:
    return min(args.limit.get(step.name, step.limit_s * slack(args)), left)


def run_all(args, out: Path) -> list[StepResult]:
    """Every chosen step in order; results written after each one."""
    results: list[StepResult] = []
    started = time.monotonic()
    peak = None
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, \
            open(out / LOG, "w") as log:
        print(f"gpu_check: {' '.join(sys.argv[1:]) or '(all steps)'}; work folder {tmp}",
              file=log, flush=True)
        for step in chosen_steps(args):
            deadline = args.deadline * slack(args)
            left = deadline - (time.monotonic() - started)
            if left < MIN_START_S:
                results.append(StepResult(step.name, "not run", planned_s=step.planned_s,
                                          note=f"the {deadline:.0f} s deadline was reached"))
                continue
            print(f"[{time.monotonic() - started:5.0f} s] {step.name} ...", flush=True)
            result = run_step(step, step_limit(step, args, left), args, Path(tmp), log,
                              peak)
            print(f"[{time.monotonic() - started:5.0f} s] {step.name}: {result.status} "
                  f"({result.wall_s:.1f} s) {result.note}", flush=True)
            peak = result.figures.get("peak_tflops", peak) if step.name == "env" else peak
            results.append(result)
            write_outputs(out, args, results, time.monotonic() - started)
    write_outputs(out, args, results, time.monotonic() - started)
    return results


def write_outputs(out: Path, args, results: list[StepResult], total_s: float) -> None:
    from gpu_check_report import summary_markdown  # beside this file

    record = {"argv": sys.argv[1:], "dry_run": args.dry_run, "total_s": total_s,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "steps": [dataclasses.asdict(r) for r in results]}
    for name, text in ((FIGURES, json.dumps(record, indent=1)),
                       (SUMMARY, summary_markdown(record))):
        (out / (name + ".tmp")).write_text(text + "\n")
        os.replace(out / (name + ".tmp"), out / name)


# Command line --------------------------------------------------------------------------------


def parse_limits(values: list[str], parser: argparse.ArgumentParser) -> dict[str, float]:
    limits = {}
    for value in values or ():
        name, _, seconds = value.partition("=")
        if name not in STEP_NAMES or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--limit {value}: expected STEP=SECONDS with STEP one of "
                         f"{', '.join(STEP_NAMES)}")
        limits[name] = float(seconds)
    return limits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="The whole GPU check in one command (see the module docstring).")
    parser.add_argument("--prepare", action="store_true",
                        help="copy what the GPU machine needs from --shared into --inputs")
    parser.add_argument("--shared", type=Path, default=SHARED,
                        help="the folder with data/ and peers/ (default: ../shared)")
    parser.add_argument("--inputs", type=Path, default=INPUTS,
                        help="the prepared folder (default: gpu-check-inputs/ in the checkout)")
    parser.add_argument("--steps", nargs="+", choices=STEP_NAMES, metavar="STEP",
                        help=f"run only these steps (of {', '.join(STEP_NAMES)})")
    parser.add_argument("--skip", nargs="+", choices=STEP_NAMES, metavar="STEP",
                        help="leave these steps out")
    parser.add_argument("--limit", nargs="+", metavar="STEP=SECONDS",
                        help="another time limit for a step")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help="seconds from the start after which no step runs "
                             f"(default {DEADLINE_S:.0f})")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step's plumbing on the CPU at tiny shapes (no GPU needed; "
                             "its figures mean nothing)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where results go (default: $OUT, else gpu-check-results/)")
    parser.add_argument("--worker", choices=STEP_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--peak-tflops", type=float, help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.prepare:
        return prepare(args.shared, args.inputs)
    if args.worker:
        from gpu_check_steps import run_worker  # beside this file

        return run_worker(args.worker, args)
    args.limit = parse_limits(args.limit, parser)
    out = args.out or Path(os.environ.get("OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    results = run_all(args, out)
    print("\n" + (out / SUMMARY).read_text(), flush=True)
    print(f"results: {out / LOG}, {out / FIGURES}, {out / SUMMARY}")
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

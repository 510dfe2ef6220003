#!/usr/bin/env python
"""Training throughput on this machine: our pretrain_gpt.py against its peers, on CPU or GPU.

    python benchmarks/train_throughput.py                    # CPU: both shapes, 3 rounds each
    python benchmarks/train_throughput.py --shapes small --rounds 3 --iters 12
    python benchmarks/train_throughput.py --device cuda      # GPU: three shapes, 3 rounds each
    python benchmarks/train_throughput.py --device cuda --shapes 1.3b --nanogpt PATH/model.py \
        --ours-args --some-flag                              # the rest goes to pretrain_gpt.py

CPU mode (the default). For each shape it runs, alternately and ``--rounds`` times each:

- ours, as a user runs it: ``python pretrain_gpt.py --mock-data ... --log-interval 1`` in a
  subprocess (single process, fp32, dropout off, DDP and optimizer wrappers of size 1, Adam,
  ``--clip-grad`` as given: Megatron's default 1.0); tokens/s is read from the log lines' TGS,
  leaving out the first ``--warmup`` iterations;
- HF: ``GPT2LMHeadModel`` at the same shape (vocabulary padded to the same 50304, dropout
  off, its default SDPA attention) in a plain loop (forward, ``F.cross_entropy`` on the same
  tokens and labels, backward, ``clip_grad_norm_`` to the same ``--clip-grad`` as HF's
  Trainer does by default, ``torch.optim.AdamW.step``, ``zero_grad``), in a subprocess.

MFU = model FLOPs per token x tokens/s / the fp32 matmul peak, measured in the same run: the
best rate of square fp32 matmuls over several sizes and repeats, taken between the runs, of
``torch.mm`` (MKL) and of oneDNN's matmul (what our linear layers use on CPU; faster here), so
both sides are measured against the faster kernel. The table also gives MFU against
``torch.mm``'s peak alone (the "fp32 matmul peak" of a plain PyTorch program, about 130-155
GFLOP/s on 2 threads here, against about 200 for oneDNN). Model FLOPs per token come from
``megatron.planning.flops.flops_per_token``::

    3 x [ L x (2h*3a + 2a*h + 4h*f + 4s*a) + 2h*V ]     (forward x 3 for forward + backward)

with L layers, hidden h, FFN width f = 4h, projection width a = h, sequence s, padded vocab V:
a matmul of m x k by k x n counts 2mkn, causal attention is counted in full, recomputation is
not counted. The same count is used for HF (the same architecture).

The CPU is usually shared, so figures are noisy: the two sides alternate, the ratio is the
median of each round's ours / HF, and the load average is printed before and after. It prints
a table; it is not a test.

GPU mode (``--device cuda``), issue 10's comparison on one GPU in bf16, sequence 1024, one
optimizer step per micro-batch, at ``gpt2-124m`` (12 layers, hidden 768, micro-batch 16),
``gpt2-350m`` (24, 1024, 8) and ``1.3b`` (24, 2048, 8); these names are GPU shapes here, so
``gpt2-124m`` means micro-batch 16 on a GPU and 1 on CPU. Five contenders, each run in its own
process so that one's allocations cannot slow or crowd another, alternate ``--rounds`` times:

- ours: ``pretrain_gpt.py --mock-data --bf16 --use-flash-attn`` with the shape, lr 6e-4 to 6e-5
  after 2 warm-up iterations, ``--clip-grad``, dropout off, plus anything after
  ``--ours-args``; tokens/s from the TGS of the log lines after ``--warmup``, as on CPU;
- ours-compile: the same with ``--compile`` (its compile time falls in the warm-up
  iterations; ``--no-ours-compile`` leaves it out);
- nanoGPT eager and nanoGPT + ``torch.compile``: its ``model.py`` imported from
  ``--nanogpt``, ``$NANOGPT_MODEL`` or ``../shared/peers/nanogpt/model.py`` (left out, with a
  note, where there is none: the GPU machine gets the repository without ../shared), trained as
  its ``train.py`` does: fp32 weights under bf16 autocast, its fused AdamW, clipping;
- HF: ``GPT2LMHeadModel`` with SDPA attention, fp32 weights under bf16 autocast, fused AdamW.

The peers (``benchmarks/gpu_peers.py``) run ``--warmup`` steps, then time ``--iters`` steps
between two ``torch.cuda.synchronize()`` calls on one token batch drawn on the GPU, which is the
fastest they can be timed; ours synchronizes every iteration to log it. TFLOP/s uses the FLOPs
per token above; MFU is against a bf16 peak measured in the run: the best rate of square bf16
``torch.mm`` at 4096, 6144 and 8192, in its own process before the first shape and after each
one. Peak memory is ``torch.cuda.max_memory_allocated()`` for the peers and, for ours, the
``max allocated`` of the framework's last ``memory (MB)`` log line ("n/a" where there is none).
A run that fails (out of memory, a missing package such as flash-attn) is reported and left
out of the medians. It prints a table per shape, a markdown table, and whether issue 10's goal
is met by the faster of ours and ours-compile at each shape: >= 1.1x nanoGPT + compile at all
three shapes and >= 60% MFU at 1.3b.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHARED = os.path.join(REPO, os.path.pardir, "shared", "data", "gpt2")
PADDED_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int

    @property
    def tokens_per_iteration(self) -> int:
        return self.seq * self.micro_batch

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, "
                f"micro-batch {self.micro_batch}, vocab {PADDED_VOCAB}")


SHAPES = {
    "small": Shape("small", 6, 384, 6, 256, 8),
    "gpt2-124m": Shape("gpt2-124m", 12, 768, 12, 1024, 1),
}
# One GPU, bf16: the shapes of issue 10 (global batch = micro-batch).
GPU_SHAPES = {
    "gpt2-124m": Shape("gpt2-124m", 12, 768, 12, 1024, 16),
    "gpt2-350m": Shape("gpt2-350m", 24, 1024, 16, 1024, 8),
    "1.3b": Shape("1.3b", 24, 2048, 16, 1024, 8),
}
SHAPES_BY_DEVICE = {"cpu": SHAPES, "cuda": GPU_SHAPES}


def flops_per_token(shape: Shape) -> float:
    # lazy: importable once main() has put the checkout on sys.path; --help imports no torch
    from megatron.config import ModelConfig
    from megatron.planning.flops import flops_per_token as megatron_flops

    config = ModelConfig(num_layers=shape.layers, hidden_size=shape.hidden,
                         num_attention_heads=shape.heads, seq_length=shape.seq,
                         max_position_embeddings=shape.seq, vocab_size=50257)
    assert config.padded_vocab_size == PADDED_VOCAB
    return megatron_flops(config)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# fp32 matmul peak -------------------------------------------------------------------------


def matmul_peak_gflops(sizes=(1024, 2048, 3072), repeats: int = 5) -> dict[str, float]:
    """The best fp32 rate over square sizes, in GFLOP/s, on torch's threads: of ``torch.mm``
    (MKL here) and of oneDNN's matmul (which our linear layers use on CPU)."""
    import torch

    # lazy: importable once main() has put the checkout on sys.path; --help imports no torch
    from megatron.core.tensor_parallel.layers import matmul_nt

    kernels = {"torch.mm": lambda a, b, c: torch.mm(a, b, out=c),
               "oneDNN": lambda a, b, c: matmul_nt(a, b)}
    best = dict.fromkeys(kernels, 0.0)
    for n in sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        for name, kernel in kernels.items():
            kernel(a, b, c)
            for _ in range(repeats):
                start = time.perf_counter()
                kernel(a, b, c)
                best[name] = max(best[name], 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


# Ours: pretrain_gpt.py --------------------------------------------------------------------

def _tokenizer_args() -> list[str]:
    if os.path.exists(os.path.join(SHARED, "gpt2-vocab.json")):
        return ["--vocab-file", os.path.join(SHARED, "gpt2-vocab.json"),
                "--merge-file", os.path.join(SHARED, "gpt2-merges.txt")]
    # the same padded vocabulary without the GPT-2 files
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]


def _shape_args(shape: Shape) -> list[str]:
    return [
        "--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
        "--num-attention-heads", str(shape.heads), "--seq-length", str(shape.seq),
        "--max-position-embeddings", str(shape.seq),
        "--micro-batch-size", str(shape.micro_batch),
        "--global-batch-size", str(shape.micro_batch),
    ]


def pretrain_command(shape: Shape, iters: int, clip_grad: float) -> list[str]:
    return [
        sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--mock-data", *_tokenizer_args(),
        *_shape_args(shape),
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-4", "--clip-grad", str(clip_grad), "--train-iters", str(iters),
        "--log-interval", "1", "--eval-iters", "0",
    ]


def tokens_per_second_from_log(log: str, warmup: int, tokens_per_iteration: int) -> float:
    """Tokens over time for the logged iterations after ``warmup`` (each line's TGS covers one
    iteration at --log-interval 1)."""
    # lazy: importable once main() has put the checkout on sys.path; --help imports no torch
    from megatron.training.log import parse_log_lines

    tgs = [line["tokens per GPU per second (TGS)"] for line in parse_log_lines(log)
           if line["iteration"] > warmup]
    if not tgs:
        raise RuntimeError(f"no iteration lines after the first {warmup} in the log:\n{log[-2000:]}")
    seconds = sum(tokens_per_iteration / rate for rate in tgs)
    return len(tgs) * tokens_per_iteration / seconds


def load_sibling(name: str):
    """``benchmarks/{name}.py`` as a module, by path (benchmarks/ is not a package);
    registered in sys.modules, which dataclasses need."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_logged(command: list[str], timeout: Optional[float] = None,
               env: Optional[dict[str, str]] = None) -> str:
    """stdout of ``command`` run in the repository; a RuntimeError with the tails if it fails
    or runs past ``timeout`` seconds (then it is stopped, with whatever it started)."""
    limits = load_sibling("time_limit")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        status = limits.run_with_time_limit(command, timeout, stdout=out, stderr=err, cwd=REPO,
                                            env=env)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if status != 0:
        what = (f"ran past {timeout:.0f} s and was stopped" if status is None
                else f"failed (exit status {status})")
        raise RuntimeError(f"{' '.join(command)} {what}:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return stdout


def run_ours(shape: Shape, iters: int, warmup: int, clip_grad: float) -> float:
    log = run_logged(pretrain_command(shape, iters, clip_grad))
    return tokens_per_second_from_log(log, warmup, shape.tokens_per_iteration)


# HF: GPT2LMHeadModel in a plain loop (run in a subprocess by run_hf) -----------------------


def hf_loop(shape: Shape, iters: int, warmup: int, clip_grad: float) -> float:
    """Tokens/s of a plain AdamW training loop of HF's GPT-2 after ``warmup`` iterations."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=PADDED_VOCAB, n_positions=shape.seq, n_embd=shape.hidden,
                        n_layer=shape.layers, n_head=shape.heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    sample = torch.randint(0, 50257, (shape.micro_batch, shape.seq + 1))
    tokens, labels = sample[:, :-1], sample[:, 1:]
    elapsed = 0.0
    for i in range(iters):
        start = time.perf_counter()
        logits = model(input_ids=tokens).logits  # [b, s, V]
        loss = F.cross_entropy(logits.view(-1, PADDED_VOCAB), labels.reshape(-1))
        loss.backward()
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if i >= warmup:
            elapsed += time.perf_counter() - start
    return (iters - warmup) * shape.tokens_per_iteration / elapsed


def run_hf(shape: Shape, iters: int, warmup: int, clip_grad: float) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--hf-worker", shape.name,
               "--iters", str(iters), "--warmup", str(warmup), "--clip-grad", str(clip_grad)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"HF loop failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"]


# GPU mode: ours, nanoGPT (eager and compiled) and HF, each run in its own process ----------

PEERS = os.path.join(HERE, "gpu_peers.py")
OURS = ("ours", "ours-compile")  # pretrain_gpt.py as is, and with --compile
_MEMORY_LINE = re.compile(r"memory \(MB\) \|.*?\| max allocated: ([\d.]+)")
# --dry-run: every GPU shape at this size, on the CPU.
DRY_RUN_SHAPE = Shape("tiny", 2, 64, 4, 64, 2)


@dataclass(frozen=True)
class GpuMode:
    """Where the GPU comparison runs. On a GPU as documented; with ``dry_run``, its whole
    machinery (every contender's process, parsing, summaries, the goal, --json) on the CPU at
    ``DRY_RUN_SHAPE`` under each GPU shape's name, with torch.compile off in the children
    (``TORCH_COMPILE_DISABLE=1``: compiling on 2 CPU cores takes minutes): a check of the
    plumbing, not a measurement."""

    dry_run: bool = False

    @property
    def shapes(self) -> dict[str, Shape]:
        if not self.dry_run:
            return GPU_SHAPES
        return {name: replace(DRY_RUN_SHAPE, name=name) for name in GPU_SHAPES}

    @property
    def peer_args(self) -> list[str]:
        return ["--device", "cpu"] if self.dry_run else []

    @property
    def ours_args(self) -> tuple[str, ...]:
        return ("--use-cpu",) if self.dry_run else ()

    @property
    def peak_args(self) -> list[str]:
        return ["--device", "cpu", "--sizes", "128", "256"] if self.dry_run else []

    @property
    def child_env(self) -> Optional[dict[str, str]]:
        return {**os.environ, "TORCH_COMPILE_DISABLE": "1"} if self.dry_run else None


def gpu_pretrain_command(shape: Shape, iters: int, clip_grad: float,
                         extra: tuple[str, ...] = ()) -> list[str]:
    """ours in bf16 with flash attention, as a user trains on one GPU; ``extra`` is appended."""
    return [
        sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--mock-data", *_tokenizer_args(),
        "--bf16", "--use-flash-attn", *_shape_args(shape),
        "--train-iters", str(iters), "--lr", "6e-4", "--min-lr", "6e-5",
        "--lr-warmup-iters", "2", "--clip-grad", str(clip_grad),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "100000",
        "--make-vocab-size-divisible-by", "128", *extra,
    ]


def max_allocated_from_log(log: str) -> Optional[float]:
    """``max allocated`` (MB) of the last Megatron memory line, or None where there is none."""
    found = _MEMORY_LINE.findall(log)
    return float(found[-1]) if found else None


def load_peers():
    """gpu_peers.py as a module."""
    return load_sibling("gpu_peers")


def run_worker(arguments: list[str], mode: GpuMode = GpuMode(),
               timeout: Optional[float] = None) -> dict:
    """The JSON that gpu_peers.py prints last."""
    out = run_logged([sys.executable, PEERS, *arguments], timeout=timeout, env=mode.child_env)
    return json.loads(out.strip().splitlines()[-1])


def run_gpu_contender(name: str, shape: Shape, args, mode: GpuMode = GpuMode()) -> dict:
    """tokens/s and peak memory (MB, or None) of one run of one contender."""
    timeout = args.contender_timeout
    if name in OURS:
        extra = (*mode.ours_args, *args.ours_args,
                 *(("--compile",) if name == "ours-compile" else ()))
        log = run_logged(gpu_pretrain_command(shape, args.iters + args.warmup, args.clip_grad,
                                              extra), timeout=timeout, env=mode.child_env)
        return {"tokens_per_s": tokens_per_second_from_log(log, args.warmup,
                                                           shape.tokens_per_iteration),
                "peak_memory_mb": max_allocated_from_log(log)}
    nanogpt = ["--nanogpt", args.nanogpt] if args.nanogpt else []
    return run_worker([
        name, "--layers", str(shape.layers), "--hidden", str(shape.hidden),
        "--heads", str(shape.heads), "--seq", str(shape.seq), "--batch", str(shape.micro_batch),
        "--vocab", str(PADDED_VOCAB), "--iters", str(args.iters), "--warmup", str(args.warmup),
        "--clip-grad", str(args.clip_grad), *nanogpt, *mode.peer_args,
    ], mode, timeout)


def benchmark_gpu_shape(shape: Shape, contenders: list[str], args, mode: GpuMode = GpuMode(),
                        results: Optional[dict[str, list]] = None,
                        on_result: Callable[[], None] = lambda: None) -> dict[str, list]:
    """Per contender, one result per round (None where the run failed); contenders alternate.
    ``results`` (filled in place) and ``on_result`` (called after each run) let the caller
    keep what is done so far."""
    results = {name: [] for name in contenders} if results is None else results
    results.update({name: [] for name in contenders})
    for round_ in range(1, args.rounds + 1):
        for name in contenders:
            try:
                results[name].append(run_gpu_contender(name, shape, args, mode))
                print(f"  [{shape.name}] {name}, round {round_}: "
                      f"{results[name][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
            except RuntimeError as error:  # a failed contender (OOM, missing package) is reported
                print(f"  [{shape.name}] {name}, round {round_}, failed:\n{str(error)[-3000:]}")
                results[name].append(None)
            on_result()
        print(f"  [{shape.name}] round {round_}: " + ", ".join(
            f"{name} {r['tokens_per_s']:.0f}" if r else f"{name} failed"
            for name, r in ((n, results[n][-1]) for n in contenders)) + " tokens/s", flush=True)
    return results


def summarize(shape: Shape, results: dict[str, list], peak_tflops: float) -> dict[str, dict]:
    """Per contender: median tokens/s, TFLOP/s, MFU, peak memory, and ours / it."""
    flops = flops_per_token(shape)
    summary = {}
    for name, runs in results.items():
        rates = [r["tokens_per_s"] for r in runs if r]
        memory = [r["peak_memory_mb"] for r in runs if r and r["peak_memory_mb"] is not None]
        ratios = [o["tokens_per_s"] / r["tokens_per_s"]
                  for o, r in zip(results["ours"], runs) if o and r]
        median = statistics.median(rates) if rates else None
        tflops = median * flops / 1e12 if median else None
        summary[name] = dict(tokens_per_s=median, rounds=rates, tflops=tflops,
                             mfu=tflops / peak_tflops if tflops else None,
                             memory_mb=max(memory) if memory else None,
                             ours_over=statistics.median(ratios) if ratios else None,
                             ratio_rounds=ratios)
    return summary


def _cell(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _percent(fraction: Optional[float]) -> Optional[float]:
    return None if fraction is None else 100 * fraction


def print_gpu_shape(shape: Shape, summary: dict[str, dict]) -> None:
    print(f"\n{shape.name}: {shape.describe()}, bf16, "
          f"model FLOPs per token: {flops_per_token(shape) / 1e6:.1f} M")
    print(f"  {'':16s} {'tokens/s median':>16s} {'TFLOP/s':>8s} {'MFU':>7s} "
          f"{'peak MB':>9s} {'ours / it':>10s}   per round")
    for name, s in summary.items():
        print(f"  {name:16s} {_cell(s['tokens_per_s'], '16.0f')} {_cell(s['tflops'], '8.1f')} "
              f"{_cell(_percent(s['mfu']), '6.1f', '%')} "
              f"{_cell(s['memory_mb'], '9.0f')} {_cell(s['ours_over'], '10.3f')}   "
              + ", ".join(f"{v:.0f}" for v in s["rounds"]))
    for name, s in summary.items():
        if name != "ours" and s["ratio_rounds"]:
            print(f"  ours / {name}: median of rounds {s['ours_over']:.3f} "
                  f"(rounds: {', '.join(f'{x:.3f}' for x in s['ratio_rounds'])})")


def print_gpu_table(summaries: dict[str, dict[str, dict]]) -> None:
    print("\n| shape | contender | tokens/s | TFLOP/s | MFU | peak memory (MB) | ours / it |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape_name, summary in summaries.items():
        for name, s in summary.items():
            print(f"| {shape_name} | {name} | {_cell(s['tokens_per_s'], '.0f')} "
                  f"| {_cell(s['tflops'], '.1f')} | {_cell(_percent(s['mfu']), '.1f', '%')} "
                  f"| {_cell(s['memory_mb'], '.0f')} | {_cell(s['ours_over'], '.3f')} |")


def best_of_ours(summary: dict[str, dict]) -> Optional[str]:
    """The faster of ours and ours-compile at one shape (by median tokens/s), if any ran."""
    ran = [name for name in OURS if summary.get(name, {}).get("tokens_per_s")]
    return max(ran, key=lambda name: summary[name]["tokens_per_s"]) if ran else None


def goal_status(summaries: dict[str, dict[str, dict]]) -> dict:
    """Issue 10's goal, for our faster variant at each shape: >= 1.1x nanoGPT+compile at
    each shape (``compile_check``), >= 60% MFU at 1.3b (``mfu_check``); each "met", "not met"
    or "not measured ..."."""
    ratios, used = {}, {}
    for shape, s in summaries.items():
        best = best_of_ours(s)
        peer = s.get("nanogpt-compile", {}).get("tokens_per_s")
        used[shape] = best
        ratios[shape] = s[best]["tokens_per_s"] / peer if best and peer else None
    if set(ratios) != set(GPU_SHAPES) or None in ratios.values():
        compile_check = "not measured at all three shapes"
    else:
        compile_check = "met" if all(r >= 1.1 for r in ratios.values()) else "not met"
    best_13b = used.get("1.3b")
    mfu = summaries["1.3b"][best_13b]["mfu"] if best_13b else None
    mfu_check = "not measured" if mfu is None else ("met" if mfu >= 0.6 else "not met")
    return dict(ratios=ratios, used=used, compile_check=compile_check, mfu_1_3b=mfu,
                mfu_used=best_13b, mfu_check=mfu_check)


def print_goal(summaries: dict[str, dict[str, dict]]) -> None:
    goal = goal_status(summaries)
    ratios, used = goal["ratios"], goal["used"]
    print(f"\ngoal (issue 10): ours >= 1.1x nanoGPT+compile at all three shapes: "
          f"{goal['compile_check']} ("
          + ", ".join(f"{k} {_cell(v, '.3f')} by {used[k]}" for k, v in ratios.items())
          + f"); ours >= 60% MFU at 1.3b: {goal['mfu_check']} "
          + f"({_cell(_percent(goal['mfu_1_3b']), '.1f', '%')}"
          + (f" by {goal['mfu_used']})" if goal["mfu_used"] else ")"))


def gpu_contenders(args) -> list[str]:
    """The contenders of this run; sets ``args.nanogpt`` to the model.py found, or None
    (nanoGPT is then left out, with a note)."""
    ours = ["ours"] if args.no_ours_compile else list(OURS)
    args.nanogpt = load_peers().find_nanogpt(args.nanogpt)
    if args.nanogpt is None:
        print("note: nanoGPT's model.py not found (--nanogpt, $NANOGPT_MODEL, ../shared/peers): "
              "nanoGPT is left out")
        return [*ours, "hf"]
    return [*ours, "nanogpt", "nanogpt-compile", "hf"]


def measure_peak(args, mode: GpuMode) -> Optional[dict]:
    """One bf16 matmul peak measurement in its own process, or None with --peak-tflops."""
    if args.peak_tflops is not None:
        return None
    return run_worker(["matmul-peak", *mode.peak_args], mode, args.contender_timeout)


def write_json(path: str, record: dict) -> None:
    """``record`` as JSON at ``path``, written whole (a temporary name, then renamed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def main_gpu(args) -> None:
    import torch

    mode = GpuMode(args.dry_run)
    if not mode.dry_run and not torch.cuda.is_available():  # the parent makes no CUDA context
        sys.exit("--device cuda: no CUDA device is visible")
    args.iters = 20 if args.iters is None else args.iters
    contenders = gpu_contenders(args)
    # The peak runs in its own process too, before the first shape and after each one.
    peaks = [p for p in [measure_peak(args, mode)] if p]
    device_name = peaks[0]["device_name"] if peaks else "the GPU"
    first = (f"{peaks[0]['tflops']:.1f} TFLOP/s (first measurement)" if peaks
             else f"{args.peak_tflops:.1f} TFLOP/s (given with --peak-tflops)")
    print(f"{device_name}, torch {torch.__version__}, one GPU, bf16; bf16 matmul peak {first}"
          + (" [--dry-run: the machinery on the CPU at a tiny shape, compile off; "
             "not a measurement]" if mode.dry_run else ""), flush=True)
    results: dict[str, dict[str, list]] = {}

    def record(complete: bool) -> None:
        """--json: what is measured so far (a run stopped from outside keeps it)."""
        if args.json:
            peak = max(p["tflops"] for p in peaks) if peaks else args.peak_tflops
            write_json(args.json, gpu_record(results, peaks, peak, contenders, args, mode,
                                             device_name, complete))

    for name in args.shapes:
        shape = mode.shapes[name]
        command = gpu_pretrain_command(shape, args.iters + args.warmup, args.clip_grad,
                                       (*mode.ours_args, *args.ours_args))
        print(f"\n[{name}] ours: {' '.join(command)}".replace(REPO + os.sep, ""), flush=True)
        results[name] = {}
        benchmark_gpu_shape(shape, contenders, args, mode, results[name],
                            lambda: record(complete=False))
        peaks += [p for p in [measure_peak(args, mode)] if p]
    peak = max(p["tflops"] for p in peaks) if peaks else args.peak_tflops
    measured = ", ".join(f"{p['tflops']:.1f}" for p in peaks) or "given with --peak-tflops"
    print(f"\n{device_name}, torch {torch.__version__}: bf16 matmul peak "
          f"{peak:.1f} TFLOP/s (the best square bf16 torch.mm over the run; "
          f"measurements: {measured})")
    summaries = {name: summarize(mode.shapes[name], r, peak) for name, r in results.items()}
    for name, summary in summaries.items():
        print_gpu_shape(mode.shapes[name], summary)
    print_gpu_table(summaries)
    print_goal(summaries)
    record(complete=True)


def gpu_record(results: dict[str, dict[str, list]], peaks: list[dict], peak: float,
               contenders: list[str], args, mode: GpuMode, device_name: str,
               complete: bool) -> dict:
    """Every figure of the GPU comparison as plain data (--json)."""
    import torch

    summaries = {name: summarize(mode.shapes[name], r, peak) for name, r in results.items()}
    return dict(
        device_name=device_name, torch=torch.__version__, dry_run=mode.dry_run,
        complete=complete, peak_tflops=peak, peak_measurements=[p["tflops"] for p in peaks],
        contenders=contenders, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
        shapes={name: dict(describe=mode.shapes[name].describe(),
                           flops_per_token=flops_per_token(mode.shapes[name]),
                           contenders=summary) for name, summary in summaries.items()},
        goal=goal_status(summaries))


# Driver ------------------------------------------------------------------------------------


def benchmark_shape(shape: Shape, args) -> dict:
    ours, hf, peaks = [], [], [matmul_peak_gflops()]
    for _ in range(args.rounds):
        ours.append(run_ours(shape, args.iters + args.warmup, args.warmup, args.clip_grad))
        peaks.append(matmul_peak_gflops())
        hf.append(run_hf(shape, args.iters + args.warmup, args.warmup, args.clip_grad))
        peaks.append(matmul_peak_gflops())
    by_kernel = {name: max(p[name] for p in peaks) for name in peaks[0]}
    return dict(ours=ours, hf=hf, peak=max(by_kernel.values()), by_kernel=by_kernel)


def print_table(shape: Shape, r: dict, flops: float) -> None:
    ratios = [o / h for o, h in zip(r["ours"], r["hf"])]
    peak = r["peak"]
    print(f"\n{shape.name}: {shape.describe()}")
    kernels = ", ".join(f"{name} {value:.1f}" for name, value in r["by_kernel"].items())
    print(f"  model FLOPs per token: {flops / 1e6:.1f} M   fp32 matmul peak: {peak:.1f} GFLOP/s "
          f"(best over the run of {kernels})")
    mkl = r["by_kernel"]["torch.mm"]
    print(f"  {'':6s} {'tokens/s median':>16s} {'best':>8s} {'MFU median':>11s} {'MFU best':>9s}"
          f" {'MFU vs torch.mm':>16s}   per round")
    for name in ("ours", "hf"):
        values = r[name]
        med, best = statistics.median(values), max(values)
        print(f"  {name:6s} {med:16.1f} {best:8.1f} {100 * med * flops / 1e9 / peak:10.1f}% "
              f"{100 * best * flops / 1e9 / peak:8.1f}% {100 * med * flops / 1e9 / mkl:15.1f}%   "
              + ", ".join(f"{v:.1f}" for v in values))
    print(f"  ours / HF: median of rounds {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}), best / best "
          f"{max(r['ours']) / max(r['hf']):.3f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=list(SHAPES_BY_DEVICE), default="cpu",
                        help="cpu: ours against HF in fp32; cuda: ours against nanoGPT (eager "
                             "and compiled) and HF in bf16 on one GPU")
    names = list(dict.fromkeys([*SHAPES, *GPU_SHAPES]))
    parser.add_argument("--shapes", nargs="+", choices=names,
                        help=f"default: all of the device's (cpu: {', '.join(SHAPES)}; "
                             f"cuda: {', '.join(GPU_SHAPES)})")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per shape")
    parser.add_argument("--iters", type=int, default=None,
                        help="measured iterations per run (default: 10 small, 6 gpt2-124m; "
                             "20 on cuda)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out per run")
    parser.add_argument("--clip-grad", type=float, default=1.0,
                        help="gradient clipping on both sides (0 turns it off)")
    parser.add_argument("--nanogpt", metavar="PATH",
                        help="cuda: nanoGPT's model.py (default: $NANOGPT_MODEL, else "
                             "../shared/peers/nanogpt/model.py; nanoGPT is left out if none)")
    parser.add_argument("--no-ours-compile", action="store_true",
                        help="cuda: leave out ours with --compile")
    parser.add_argument("--ours-args", nargs=argparse.REMAINDER, default=[],
                        help="cuda, last option: the rest of the line goes to pretrain_gpt.py")
    parser.add_argument("--json", metavar="PATH",
                        help="cuda: also write every figure (per shape and contender, the peak "
                             "and the goal) as JSON to PATH")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="cuda: take MFU against this bf16 peak (TFLOP/s, measured earlier "
                             "in the same session) instead of measuring it before and after "
                             "each shape")
    parser.add_argument("--contender-timeout", type=float, default=None, metavar="SECONDS",
                        help="cuda: stop a contender's run (and what it started) after this "
                             "long and report it failed; default: no limit")
    parser.add_argument("--dry-run", action="store_true",
                        help="cuda: run the whole GPU comparison's machinery on the CPU at a "
                             "tiny shape with torch.compile off, to check it works; its "
                             "figures mean nothing")
    parser.add_argument("--hf-worker", choices=list(SHAPES), help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf_worker:
        shape = SHAPES[args.hf_worker]
        print(json.dumps({"tokens_per_s": hf_loop(shape, args.iters, args.warmup,
                                                  args.clip_grad)}))
        return
    shapes = SHAPES_BY_DEVICE[args.device]
    args.shapes = args.shapes or list(shapes)
    unknown = [name for name in args.shapes if name not in shapes]
    if unknown:
        parser.error(f"--shapes {' '.join(unknown)}: not a {args.device} shape "
                     f"(choose from {', '.join(shapes)})")
    gpu_only = {"--nanogpt": args.nanogpt, "--ours-args": args.ours_args, "--json": args.json,
                "--peak-tflops": args.peak_tflops, "--dry-run": args.dry_run,
                "--contender-timeout": args.contender_timeout}
    given = [flag for flag, value in gpu_only.items() if value]
    if args.device == "cpu" and given:
        parser.error(f"{', '.join(given)}: only with --device cuda")
    sys.path.insert(0, REPO)
    if args.device == "cuda":
        return main_gpu(args)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, fp32, single process")
    print(f"load average at start: {load_average()}")
    for name in args.shapes:
        shape = SHAPES[name]
        shape_args = argparse.Namespace(**vars(args))
        if shape_args.iters is None:
            shape_args.iters = 10 if name == "small" else 6
        command = pretrain_command(shape, shape_args.iters + args.warmup, args.clip_grad)
        print(f"\n[{name}] ours: {' '.join(command)}".replace(REPO + os.sep, ""), flush=True)
        results = benchmark_shape(shape, shape_args)
        print_table(shape, results, flops_per_token(shape))
        print(f"  load average now: {load_average()}", flush=True)


if __name__ == "__main__":
    main()

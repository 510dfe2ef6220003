#!/usr/bin/env python
"""Training throughput on this machine: our pretrain_gpt.py against HF transformers' GPT-2.

    python benchmarks/train_throughput.py                    # both shapes, 3 rounds each
    python benchmarks/train_throughput.py --shapes small --rounds 3 --iters 12

For each shape it runs, alternately and ``--rounds`` times each:

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
``megatron.training_log.flops_per_token``::

    3 x [ L x (2h*3a + 2a*h + 4h*f + 4s*a) + 2h*V ]     (forward x 3 for forward + backward)

with L layers, hidden h, FFN width f = 4h, projection width a = h, sequence s, padded vocab V:
a matmul of m x k by k x n counts 2mkn, causal attention is counted in full, recomputation is
not counted. The same count is used for HF (the same architecture).

The CPU is usually shared, so figures are noisy: the two sides alternate, the ratio is the
median of each round's ours / HF, and the load average is printed before and after. It prints
a table; it is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
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


def flops_per_token(shape: Shape) -> float:
    from megatron.config import ModelConfig
    from megatron.training_log import flops_per_token as megatron_flops

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

_LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*tokens per GPU per second \(TGS\): ([\d.]+)")


def pretrain_command(shape: Shape, iters: int, clip_grad: float) -> list[str]:
    if os.path.exists(os.path.join(SHARED, "gpt2-vocab.json")):
        tokenizer = ["--vocab-file", os.path.join(SHARED, "gpt2-vocab.json"),
                     "--merge-file", os.path.join(SHARED, "gpt2-merges.txt")]
    else:  # the same padded vocabulary without the GPT-2 files
        tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]
    return [
        sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--mock-data", *tokenizer,
        "--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
        "--num-attention-heads", str(shape.heads), "--seq-length", str(shape.seq),
        "--max-position-embeddings", str(shape.seq),
        "--micro-batch-size", str(shape.micro_batch),
        "--global-batch-size", str(shape.micro_batch),
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-4", "--clip-grad", str(clip_grad), "--train-iters", str(iters),
        "--log-interval", "1", "--eval-iters", "0",
    ]


def tokens_per_second_from_log(log: str, warmup: int, tokens_per_iteration: int) -> float:
    """Tokens over time for the logged iterations after ``warmup`` (each line's TGS covers one
    iteration at --log-interval 1)."""
    tgs = [float(m.group(2)) for m in _LOG_LINE.finditer(log) if int(m.group(1)) > warmup]
    if not tgs:
        raise RuntimeError(f"no iteration lines after the first {warmup} in the log:\n{log[-2000:]}")
    seconds = sum(tokens_per_iteration / rate for rate in tgs)
    return len(tgs) * tokens_per_iteration / seconds


def run_ours(shape: Shape, iters: int, warmup: int, clip_grad: float) -> float:
    command = pretrain_command(shape, iters, clip_grad)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-3000:]}")
    return tokens_per_second_from_log(result.stdout, warmup, shape.tokens_per_iteration)


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per shape")
    parser.add_argument("--iters", type=int, default=None,
                        help="measured iterations per run (default: 10 small, 6 gpt2-124m)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out per run")
    parser.add_argument("--clip-grad", type=float, default=1.0,
                        help="gradient clipping on both sides (0 turns it off)")
    parser.add_argument("--hf-worker", choices=list(SHAPES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hf_worker:
        shape = SHAPES[args.hf_worker]
        print(json.dumps({"tokens_per_s": hf_loop(shape, args.iters, args.warmup,
                                                  args.clip_grad)}))
        return
    sys.path.insert(0, REPO)
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

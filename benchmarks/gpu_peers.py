#!/usr/bin/env python
"""The peers of ``train_throughput.py --device cuda``, each run in its own process by it.

    python benchmarks/gpu_peers.py nanogpt --layers 12 --hidden 768 --heads 12 --batch 16
    python benchmarks/gpu_peers.py matmul-peak

Each contender prints one JSON line last: ``tokens_per_s``, ``loss`` (of the last step),
``peak_memory_mb`` (``torch.cuda.max_memory_allocated()``; null on CPU) and ``device_name``.

- ``nanogpt`` / ``nanogpt-compile``: nanoGPT's own ``model.py`` (imported from a path, never
  copied), trained as its ``train.py`` does: fp32 weights under bf16 autocast, its
  ``configure_optimizers`` (AdamW, fused on CUDA, weight decay 0.1, betas 0.9/0.95),
  ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``, TF32 allowed, and, for the second,
  ``torch.compile`` of the model after the optimizer is made.
- ``hf``: HF transformers' ``GPT2LMHeadModel`` with SDPA attention, fp32 weights under bf16
  autocast, ``F.cross_entropy`` on its logits, AdamW (fused on CUDA), ``clip_grad_norm_``.
- ``matmul-peak``: the best bf16 ``torch.mm`` rate over square sizes, the "peak" that MFU is
  taken against.

The token batch is drawn once, on the device. ``--warmup`` steps run first (compilation happens
there); then ``--iters`` steps are timed between two ``torch.cuda.synchronize()`` calls with no
other synchronization inside, so a peer is timed at its fastest. ``--device cpu --autocast
none`` runs the same loops in fp32 on CPU, which is how the unit test checks them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
DEFAULT_NANOGPT = os.path.join(REPO, os.pardir, "shared", "peers", "nanogpt", "model.py")
CONTENDERS = ("nanogpt", "nanogpt-compile", "hf")


@dataclass(frozen=True)
class PeerRun:
    """One peer's training run: model shape, batch, step counts and numerics."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int
    iters: int
    warmup: int
    clip_grad: float = 1.0
    device: str = "cuda"
    autocast: Optional[str] = "bfloat16"  # None: plain fp32

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


def find_nanogpt(path: Optional[str] = None) -> Optional[str]:
    """nanoGPT's model.py: ``path`` if given, else $NANOGPT_MODEL, else ../shared/peers; None
    where none of them exists (the GPU machine gets the repository without ../shared)."""
    for candidate in (path, os.environ.get("NANOGPT_MODEL"), DEFAULT_NANOGPT):
        if candidate and os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def load_nanogpt(path: str):
    """nanoGPT's model.py as a module (registered in sys.modules for dataclasses and dynamo)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# The timed loop ----------------------------------------------------------------------------


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _autocast(run: PeerRun):
    import torch

    device_type = run.device.split(":")[0]
    if run.autocast is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=getattr(torch, run.autocast))


def _token_batch(run: PeerRun):
    """tokens, labels: ``[b, s]`` each, labels the tokens shifted by one, on the device."""
    import torch

    torch.manual_seed(0)
    sample = torch.randint(0, run.vocab, (run.batch, run.seq + 1), device=run.device)
    return sample[:, :-1].contiguous(), sample[:, 1:].contiguous()


def time_steps(step: Callable[[], object], run: PeerRun) -> dict:
    """Runs ``run.warmup`` then ``run.iters`` timed steps; ``step`` returns the loss tensor."""
    import torch

    for _ in range(run.warmup):
        step()
    _synchronize(run.device)
    start = time.perf_counter()
    for _ in range(run.iters):
        loss = step()
    _synchronize(run.device)
    seconds = time.perf_counter() - start
    cuda = run.device.startswith("cuda")
    return {
        "tokens_per_s": run.iters * run.tokens_per_step / seconds,
        "loss": float(loss.item()),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
    }


def _allow_tf32(run: PeerRun) -> None:
    import torch

    # As nanoGPT's train.py does; it only reaches the few fp32 matmuls outside autocast.
    if run.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


# nanoGPT -----------------------------------------------------------------------------------


def nanogpt_loop(run: PeerRun, model_path: str, compile: bool = False) -> dict:
    """nanoGPT's GPT trained as its train.py does (see the module docstring)."""
    import torch

    nanogpt = load_nanogpt(model_path)
    _allow_tf32(run)
    torch.manual_seed(0)
    config = nanogpt.GPTConfig(block_size=run.seq, vocab_size=run.vocab, n_layer=run.layers,
                               n_head=run.heads, n_embd=run.hidden, dropout=0.0, bias=True)
    model = nanogpt.GPT(config).to(run.device).train()
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4,
                                           betas=(0.9, 0.95),
                                           device_type=run.device.split(":")[0])
    if compile:
        model = torch.compile(model)
    tokens, labels = _token_batch(run)

    def step():
        with _autocast(run):
            _, loss = model(tokens, labels)
        return _update(loss, model, optimizer, run)

    return time_steps(step, run)


def _update(loss, model, optimizer, run: PeerRun):
    """backward, clip as the peer's train.py does, step, zero; returns the loss."""
    import torch

    loss.backward()
    if run.clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# HF transformers ---------------------------------------------------------------------------


def hf_loop(run: PeerRun) -> dict:
    """HF's GPT2LMHeadModel (SDPA attention) in a plain AdamW loop, as the CPU mode runs it."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    _allow_tf32(run)
    config = GPT2Config(vocab_size=run.vocab, n_positions=run.seq, n_embd=run.hidden,
                        n_layer=run.layers, n_head=run.heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(run.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=run.device.startswith("cuda"))
    tokens, labels = _token_batch(run)

    def step():
        with _autocast(run):
            logits = model(input_ids=tokens).logits  # [b, s, V]
            loss = F.cross_entropy(logits.view(-1, run.vocab), labels.view(-1))
        return _update(loss, model, optimizer, run)

    return time_steps(step, run)


# bf16 matmul peak --------------------------------------------------------------------------


def matmul_peak_tflops(sizes=(4096, 6144, 8192), repeats: int = 10, calls: int = 20,
                       device: str = "cuda") -> dict:
    """The best bf16 ``torch.mm`` rate over square sizes, in TFLOP/s: each repeat times
    ``calls`` back-to-back products between two synchronizations (so launch gaps vanish)."""
    import torch

    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        torch.mm(a, b, out=c)
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b, out=c)
            _synchronize(device)
            best = max(best, calls * 2 * n**3 / (time.perf_counter() - start) / 1e12)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {"tflops": best, "device_name": name}


# Worker entry ------------------------------------------------------------------------------


def run_contender(contender: str, run: PeerRun, nanogpt_path: Optional[str] = None) -> dict:
    if contender == "hf":
        return hf_loop(run)
    path = find_nanogpt(nanogpt_path)
    if path is None:
        raise FileNotFoundError("nanoGPT's model.py not found (--nanogpt or $NANOGPT_MODEL)")
    return nanogpt_loop(run, path, compile=contender == "nanogpt-compile")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("contender", choices=[*CONTENDERS, "matmul-peak"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--autocast", default="bfloat16", choices=["bfloat16", "none"])
    parser.add_argument("--nanogpt", help="path to nanoGPT's model.py")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 6144, 8192],
                        help="matmul-peak: the square sizes to try")
    args = parser.parse_args(argv)
    if args.contender == "matmul-peak":
        result = matmul_peak_tflops(sizes=tuple(args.sizes), device=args.device)
    else:
        run = PeerRun(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                      batch=args.batch, vocab=args.vocab, iters=args.iters, warmup=args.warmup,
                      clip_grad=args.clip_grad, device=args.device,
                      autocast=None if args.autocast == "none" else args.autocast)
        result = run_contender(args.contender, run, args.nanogpt)
        if not math.isfinite(result["loss"]):
            raise RuntimeError(f"{args.contender}: loss is {result['loss']}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

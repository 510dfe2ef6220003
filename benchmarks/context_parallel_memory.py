#!/usr/bin/env python
"""Activation memory per rank with context parallelism, on the CPU (issue 33's goal: at
sequence 16K, context parallelism 4 keeps at most 0.35x the activations of none).

    python benchmarks/context_parallel_memory.py                  # 16K, cp 4 (p2p and a2a)
    python benchmarks/context_parallel_memory.py --seq 4096 --cp 2 --iters 2

A small GPT (``SHAPE``: 2 layers, hidden 256, 4 heads, vocabulary 1024, fp32, micro-batch 1,
dropout off) takes forward and backward steps on one sequence of ``--seq`` tokens: in one
process without a split, then on ``--cp`` gloo ranks with each --cp-comm-type. Per rank:

- activations: the bytes autograd keeps for the backward pass (every tensor saved during the
  forward, counted once by storage, through ``torch.autograd.graph.saved_tensors_hooks``;
  the parameters left out), which is what a longer sequence fills (the process's peak RSS is
  not shown: on a CPU the high-water mark of the imports and the allocator's slack hide it);
- tokens/s of the whole group (each token counted once), forward and backward.

It prints a table and the ratio against the goal; it is not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)  # its ranks import this module by name where it is loaded as one

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megatron.config import ModelConfig  # noqa: E402
from megatron.core import context_parallel, parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megatron.model.gpt_batch import masked_mean_loss  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402

SHAPE = dict(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024)
GOAL = 0.35


def _config(seq: int, cp: int, kind: str) -> ModelConfig:
    return ModelConfig(**SHAPE, seq_length=seq, max_position_embeddings=seq,
                       hidden_dropout=0.0, attention_dropout=0.0,
                       position_embedding_type="rope", context_parallel_size=cp,
                       context_attention=kind)


def _saved_bytes(model, step) -> int:
    """Bytes of the distinct storages autograd saves while ``step()`` runs its forward,
    the model's parameters (saved by reference, not activations) left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(storages.values())


def _measure(seq: int, cp: int, kind: str, iters: int) -> dict:
    torch.manual_seed(0)
    model_parallel_seed(0)
    model = GPTModel(_config(seq, cp, kind))
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, seq + 1), generator=torch.Generator()
                           .manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.ones(1, seq)
    if cp > 1:
        inputs, labels, mask = (context_parallel.shard(t, 1, kind) for t in (inputs, labels, mask))

    def step():
        return masked_mean_loss(model(inputs, labels=labels), mask)

    saved = _saved_bytes(model, step)  # also the warm-up step
    start = time.perf_counter()
    for _ in range(iters):
        model.zero_grad()
        step().backward()
    elapsed = time.perf_counter() - start
    return dict(saved=saved, seconds=elapsed / iters)


def _rank(rank: int, world: int, port: int, seq: int, kind: str, iters: int, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    result = _measure(seq, world, kind, iters)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def _split_run(seq: int, cp: int, kind: str, iters: int) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(cp, port, seq, kind, iters, out), nprocs=cp, join=True,
                       start_method="spawn")
    return out.get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--kinds", default="p2p,a2a")
    parser.add_argument("--iters", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"shape {SHAPE}, sequence {args.seq}, micro-batch 1, fp32, CPU "
          f"({os.cpu_count()} cores); load average {os.getloadavg()[0]:.1f}")
    alone = _measure(args.seq, 1, "p2p", args.iters)
    rows = [("none (1 rank)", alone["saved"], args.seq / alone["seconds"])]
    for kind in args.kinds.split(","):
        ranks = _split_run(args.seq, args.cp, kind, args.iters)
        worst = max(ranks, key=lambda r: r["saved"])
        slowest = max(r["seconds"] for r in ranks)
        rows.append((f"cp {args.cp} {kind}", worst["saved"], args.seq / slowest))
    print(f"{'layout':<16} {'activations/rank (MiB)':>23} {'ratio':>6} {'tokens/s':>9}")
    verdict = 0
    for name, saved, tps in rows:
        ratio = saved / alone["saved"]
        print(f"{name:<16} {saved / 2**20:>23.1f} {ratio:>6.3f} {tps:>9.0f}")
        if name != "none (1 rank)" and ratio > GOAL:
            verdict = 1
    print(f"goal: activations per rank at most {GOAL}x of none: "
          f"{'met' if verdict == 0 else 'NOT met'}")
    return verdict


if __name__ == "__main__":
    sys.exit(main())

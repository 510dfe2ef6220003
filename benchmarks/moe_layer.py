#!/usr/bin/env python
"""The mixture-of-experts layer's training step on the CPU against Hugging Face Mixtral's
sparse block on the same shapes and weights (issue 34).

    python benchmarks/moe_layer.py                    # 4096 tokens, h 512, 8 experts, top-2
    python benchmarks/moe_layer.py --tokens 1024 --iters 2

One forward and backward pass of the layer on ``--tokens`` tokens (fp32, SwiGLU experts of
width 3.5 h, as Mixtral's), timed over ``--iters`` steps after one warm-up step:

- ours, one product per expert (``MoELayer``, the default);
- ours with ``--moe-grouped-gemm`` (torch's grouped_mm over the stacked rows);
- HF ``MixtralSparseMoeBlock`` with transformers' default expert loop, and with its
  ``grouped_mm`` experts where this transformers has them.

All read the same router and expert weights; the outputs are compared first (a benchmark of
different computations would mean nothing). It prints tokens/s and the ratio to HF's default;
it is not a test. The router losses are off (HF's block computes none).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron.config import ModelConfig  # noqa: E402
from megatron.model.moe import MoELayer  # noqa: E402
from megatron.model.transformer import ParallelMLP  # noqa: E402


def _ours(args, grouped: bool) -> MoELayer:
    # A ConfigError names the widths grouped_mm cannot take.
    config = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                         num_experts=args.experts, moe_router_topk=args.topk,
                         ffn_hidden_size=args.ffn, swiglu=True, add_bias_linear=False,
                         hidden_dropout=0.0, attention_dropout=0.0, moe_grouped_gemm=grouped)
    return MoELayer(config, 1, ParallelMLP).train()


def _hf(args, ours: MoELayer, implementation: str):
    """Mixtral's block holding ``ours``' weights, or None where transformers lacks it."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_local_experts=args.experts, num_experts_per_tok=args.topk,
                           router_jitter_noise=0.0)
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config).train()
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        for j, expert in enumerate(ours.local_experts):
            block.experts.gate_up_proj[j].copy_(expert.dense_h_to_4h.weight)
            block.experts.down_proj[j].copy_(expert.dense_4h_to_h.weight)
    return block


def _step(layer, x: torch.Tensor, grad: torch.Tensor, seq_first: bool) -> torch.Tensor:
    xi = x.clone().requires_grad_()
    out = layer(xi if seq_first else xi.transpose(0, 1).contiguous())
    out = out if seq_first else out.transpose(0, 1)
    out.backward(grad)
    return out.detach()


def _tokens_per_s(layer, x, grad, seq_first: bool, iters: int) -> float:
    _step(layer, x, grad, seq_first)  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        _step(layer, x, grad, seq_first)
    return x.shape[0] * x.shape[1] * iters / (time.perf_counter() - start)


def main(argv=None) -> list[tuple[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1792)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    loop, grouped = _ours(args, False), _ours(args, True)
    grouped.load_state_dict(loop.state_dict())
    seq = 256 if args.tokens % 256 == 0 else args.tokens
    x = torch.randn(seq, args.tokens // seq, args.hidden)  # [s, b, h]
    grad = torch.randn_like(x)
    rows = [("ours (loop)", loop, True), ("ours (--moe-grouped-gemm)", grouped, True)]
    for implementation in ("eager", "grouped_mm"):
        block = _hf(args, loop, implementation)
        if block is not None:
            rows.append((f"HF Mixtral ({implementation})", block, False))
    reference = _step(loop, x, grad, True)
    measured = []
    for name, layer, seq_first in rows:
        try:
            out = _step(layer, x, grad, seq_first)
        except Exception as error:  # noqa: BLE001 - an implementation this install lacks
            print(f"{name:30s} skipped: {str(error).splitlines()[0]}")
            continue
        diff = (out - reference).abs().max().item()
        if diff > 1e-4:
            raise SystemExit(f"error: {name} computes something else (max |diff| {diff:.2e})")
        measured.append((name, _tokens_per_s(layer, x, grad, seq_first, args.iters)))
    base = next((v for n, v in measured if n == "HF Mixtral (eager)"), measured[0][1])
    print(f"{args.tokens} tokens, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
          f"top-{args.topk}, fp32, forward + backward, {torch.get_num_threads()} threads")
    print(f"{'layer':30s} {'tokens/s':>10s} {'vs HF eager':>12s}")
    for name, value in measured:
        print(f"{name:30s} {value:10.0f} {value / base:11.2f}x")
    return measured


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""A Llama-style model's training step on CPU: our pretrain_gpt.py against Hugging Face's
``LlamaForCausalLM`` on the same shapes and tokens (issue 32's goal: at least 1.15x).

    python benchmarks/llama_throughput.py                       # 3 rounds, 12 iterations each
    python benchmarks/llama_throughput.py --rounds 5 --iters 16 --warmup 4

The shape (``SHAPE``): 6 layers, hidden 384, 6 query heads in 2 key/value groups, SwiGLU width
1024, RMSNorm, RoPE, untied embeddings, no biases, sequence 256, micro-batch 8, vocabulary
32000 (Llama 2's), fp32, dropout off. Both sides, alternately and ``--rounds`` times each,
each in its own process:

- ours, as a user runs it: ``pretrain_gpt.py --mock-data`` with the Llama flags, Adam,
  ``--clip-grad 1.0``, tokens/s from the log lines' TGS after ``--warmup`` iterations;
- HF: ``LlamaForCausalLM`` (its default SDPA attention) in a plain loop: forward,
  ``F.cross_entropy`` on the same tokens and labels, backward, ``clip_grad_norm_`` to 1.0,
  ``torch.optim.AdamW.step``, ``zero_grad``; timed after the same warm-up.

The ratio is the median of each round's ours / HF (the CPU is usually shared: the load average
is printed before and after). It prints a table; it is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

SHAPE = dict(layers=6, hidden=384, heads=6, groups=2, ffn=1024, seq=256, micro_batch=8,
             vocab=32000)
GOAL = 1.15


def _throughput():
    """benchmarks/train_throughput.py, whose log parsing and process running this shares."""
    import importlib.util

    if "train_throughput" in sys.modules:
        return sys.modules["train_throughput"]
    spec = importlib.util.spec_from_file_location("train_throughput",
                                                  os.path.join(HERE, "train_throughput.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_throughput"] = module
    spec.loader.exec_module(module)
    return module


def ours_command(iters: int) -> list[str]:
    s = SHAPE
    return [
        sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(s["vocab"] - 1),
        "--make-vocab-size-divisible-by", "128",
        "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
        "--num-attention-heads", str(s["heads"]), "--group-query-attention",
        "--num-query-groups", str(s["groups"]), "--ffn-hidden-size", str(s["ffn"]),
        "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", str(s["micro_batch"]), "--global-batch-size",
        str(s["micro_batch"]), "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-4", "--clip-grad", "1.0", "--train-iters", str(iters),
        "--log-interval", "1", "--eval-iters", "0",
    ]


def hf_loop(iters: int, warmup: int) -> float:
    """Tokens/s of a plain AdamW loop of HF's LlamaForCausalLM after ``warmup`` iterations."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPE
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                         intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["groups"],
                         max_position_embeddings=s["seq"], tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    sample = torch.randint(0, s["vocab"], (s["micro_batch"], s["seq"] + 1))
    tokens, labels = sample[:, :-1], sample[:, 1:]
    elapsed = 0.0
    for i in range(iters):
        start = time.perf_counter()
        logits = model(input_ids=tokens).logits  # [b, s, V]
        loss = F.cross_entropy(logits.reshape(-1, s["vocab"]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if i >= warmup:
            elapsed += time.perf_counter() - start
    return (iters - warmup) * s["seq"] * s["micro_batch"] / elapsed


def run_ours(iters: int, warmup: int) -> float:
    tt = _throughput()
    log = tt.run_logged(ours_command(iters))
    return tt.tokens_per_second_from_log(log, warmup, SHAPE["seq"] * SHAPE["micro_batch"])


def run_hf(iters: int, warmup: int) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--hf-worker", "--iters", str(iters),
               "--warmup", str(warmup)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"HF loop failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hf_worker:
        print(json.dumps({"tokens_per_s": hf_loop(args.iters, args.warmup)}))
        return {}
    tt = _throughput()
    print(f"shape: {SHAPE}; load average before: {tt.load_average()}")
    ours, hf = [], []
    for r in range(args.rounds):
        ours.append(run_ours(args.iters, args.warmup))
        hf.append(run_hf(args.iters, args.warmup))
        print(f"round {r + 1}: ours {ours[-1]:.0f} tokens/s, HF LlamaForCausalLM "
              f"{hf[-1]:.0f} tokens/s, ratio {ours[-1] / hf[-1]:.2f}x", flush=True)
    ratio = statistics.median(o / h for o, h in zip(ours, hf))
    print(f"load average after: {tt.load_average()}")
    print(f"| contender | tokens/s (median) |\n|---|---|\n| ours | {statistics.median(ours):.0f} "
          f"|\n| HF LlamaForCausalLM | {statistics.median(hf):.0f} |")
    print(f"ours / HF: {ratio:.2f}x (median of rounds); goal >= {GOAL}x: "
          f"{'met' if ratio >= GOAL else 'NOT met'}")
    return {"ours": ours, "hf": hf, "ratio": ratio}


if __name__ == "__main__":
    main()

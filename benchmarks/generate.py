#!/usr/bin/env python
"""Generation speed: our KV-cached generation against no cache and against Hugging Face's
``generate``, with the same model and prompts, in the same run.

    python benchmarks/generate.py                       # CPU, fp32, batch 1 and 8
    python benchmarks/generate.py --device cuda         # a GPU, bf16
    python benchmarks/generate.py --layers 12 --hidden 768 --heads 12 --new-tokens 128

The model is a randomly initialised ``GPT2LMHeadModel`` (GPT-2's vocabulary of 50257 by
default) converted to ours in memory (``megatron.model.hf_gpt2``), so both sides hold the
same weights. Each batch of prompts (random ids, ``--prompt-length`` each) is completed
greedily with exactly ``--new-tokens`` new tokens (no end-of-document stop) by:

- ours, cached: ``generate_tokens`` (one position per new token);
- ours, no cache: the same loop recomputing the whole sequence at every step;
- HF: ``model.generate(do_sample=False, use_cache=True)``.

Each is warmed up once, then timed ``--repeats`` times alternately; the table gives the
median tokens/s (new tokens of the batch / wall time), tokens per CPU-second of this process
(on a shared CPU, with ``--threads 1``, the steadier measure of the work each side does), and
whether ours produced HF's tokens. Compare within one run. It prints a table; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config import RunConfig
from megatron.inference.loading import build_inference_model  # noqa: E402
from megatron.inference.text_generation import GREEDY, generate_tokens  # noqa: E402
from megatron.model.hf_gpt2 import hf_to_megatron_state_dict, model_config_from_hf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_models(args: argparse.Namespace, device: torch.device):
    """The HF model and ours with its weights, both in eval mode on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.prompt_length + args.new_tokens,
                     n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    config = RunConfig(model=model_config_from_hf(cfg))
    full = hf_to_megatron_state_dict(hf.state_dict(), config.model)
    precision = None if args.dtype == "fp32" else args.dtype
    ours = build_inference_model(config, device=device, full_state_dict=full, dtype=precision)
    return hf.to(device=device, dtype=DTYPES[args.dtype]), ours


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def runners(hf, ours, prompts: torch.Tensor, new_tokens: int) -> dict:
    """name -> a function that completes the batch and returns its token lists."""
    as_lists = prompts.tolist()

    def ours_cached():
        return generate_tokens(ours, as_lists, new_tokens, params=GREEDY).tokens

    def ours_no_cache():
        return generate_tokens(ours, as_lists, new_tokens, params=GREEDY,
                               use_cache=False).tokens

    def hf_generate():
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, use_cache=True)
        return out.tolist()

    return {"ours (KV cache)": ours_cached, "ours (no cache)": ours_no_cache,
            "HF generate": hf_generate}


def bench_batch(hf, ours, batch: int, args: argparse.Namespace, device) -> list[tuple]:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, args.vocab, (batch, args.prompt_length), generator=g)
    fns = runners(hf, ours, prompts.to(device), args.new_tokens)
    outputs = {name: fn() for name, fn in fns.items()}  # warm-up, and the tokens to compare
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    reference = outputs["HF generate"]
    rows = []
    for name in fns:
        tokens = batch * args.new_tokens
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        rows.append((batch, name, tokens / wall, tokens / cpu, outputs[name] == reference))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default: fp32 on the CPU, bf16 on a GPU")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the table's rows (and the setting) as JSON to PATH")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    hf, ours = build_models(args, device)
    print(f"# {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, prompt {args.prompt_length} + {args.new_tokens} new tokens, "
          f"{args.dtype} on {device} ({torch.get_num_threads()} threads), median of "
          f"{args.repeats}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5}  {'generator':<16} {'tokens/s':>9} {'vs HF':>6}  "
          f"{'tokens/CPU-s':>12} {'vs HF':>6}  same tokens as HF")
    records = []
    for batch in args.batch_sizes:
        rows = bench_batch(hf, ours, batch, args, device)
        hf_row = next(r for r in rows if r[1] == "HF generate")
        for b, name, rate, cpu_rate, same in rows:
            print(f"{b:>5}  {name:<16} {rate:>9.1f} {rate / hf_row[2]:>5.2f}x  "
                  f"{cpu_rate:>12.1f} {cpu_rate / hf_row[3]:>5.2f}x  "
                  f"{'yes' if same else 'NO'}", flush=True)
            records.append(dict(batch=b, generator=name, tokens_per_s=rate,
                                vs_hf=rate / hf_row[2], tokens_per_cpu_s=cpu_rate,
                                same_tokens_as_hf=same))
    if args.json:
        write_json(args.json, records, args, device)
    return 0


def write_json(path: str, rows: list[dict], args: argparse.Namespace, device) -> None:
    setting = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                   prompt_length=args.prompt_length, new_tokens=args.new_tokens,
                   dtype=args.dtype, repeats=args.repeats, device=str(device),
                   device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                                else "cpu"))
    with open(path + ".tmp", "w") as f:
        json.dump({"setting": setting, "rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    raise SystemExit(main())

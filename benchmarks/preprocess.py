#!/usr/bin/env python
"""Preprocessing throughput: tools/preprocess_data.py against HF ``tokenizers`` encode_batch.

    python benchmarks/preprocess.py                 # 20 MB and 100 MB corpora
    python benchmarks/preprocess.py --sizes 5 --workers 2

Builds loose-JSON corpora from WikiText-2 (valid + test) cut into articles at their
`` = Title = `` headings, replicated to each size in a temporary directory. For each size it runs
the whole tool as a user would (``--workers N --append-eod``, wall time including start-up) and
reads the tool's own in-loop rate, then times HF ``tokenizers`` ``encode_batch`` on the same
texts with N threads. Prints figures and ratios; it is not a test. Numbers are noisy on a
shared machine.

For scale (measured on the development machine, 2 workers, 20 MB): Megatron-DeepSpeed's
preprocess_data.py did about 255K tokens/s for the whole process and 540K tokens/s in its loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
SHARED = os.path.join(REPO, os.path.pardir, "shared", "data")
VOCAB = os.path.join(SHARED, "gpt2", "gpt2-vocab.json")
MERGES = os.path.join(SHARED, "gpt2", "gpt2-merges.txt")
WIKITEXT = [os.path.join(SHARED, "wikitext-2", f"{name}.txt") for name in ("valid", "test")]

MDS_WHOLE_TOKENS_PER_S = 255_000  # Megatron-DeepSpeed, 20 MB, 2 workers, whole process
MDS_LOOP_TOKENS_PER_S = 540_000  # the same run, inside its processing loop

_TITLE = re.compile(r"^ = [^=].* = $")


def wikitext_articles() -> list[str]:
    """WikiText-2 articles: a new one starts at each top-level `` = Title = `` line."""
    articles: list[list[str]] = []
    for path in WIKITEXT:
        with open(path, encoding="utf-8") as f:
            for line in f.read().split("\n"):
                if _TITLE.match(line) or not articles:
                    articles.append([])
                articles[-1].append(line)
    return ["\n".join(lines) for lines in articles if "".join(lines).strip()]


def write_corpus(path: str, articles: list[str], target_mb: float) -> int:
    """Write articles as JSON lines, repeated until ``target_mb``; returns bytes written."""
    lines = [json.dumps({"text": a}, ensure_ascii=False) + "\n" for a in articles]
    written, target = 0, int(target_mb * 2**20)
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for line in lines:
                f.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break
    return written


def run_tool(corpus: str, prefix: str, workers: int) -> dict:
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
           VOCAB, "--merge-file", MERGES, "--workers", str(workers), "--append-eod",
           "--log-interval", "1000000"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    loop = re.search(r"In-loop: ([\d.]+) s .* ([\d,]+) tokens/s", proc.stdout)
    startup = re.search(r"Time to startup: ([\d.]+) s", proc.stdout)
    tokens = re.search(r"Done: \d+ documents, ([\d,]+) tokens", proc.stdout)
    return {
        "wall": wall,
        "tokens": int(tokens.group(1).replace(",", "")),
        "loop_tokens_per_s": int(loop.group(2).replace(",", "")),
        "startup": float(startup.group(1)),
    }


_HF_SNIPPET = """
import json, sys, time
import numpy as np
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
vocab = json.load(open(sys.argv[1], encoding="utf-8"))
merges = [tuple(l.split()) for l in open(sys.argv[2], encoding="utf-8").read().split("\\n")[1:]
          if l.strip()]
tok = Tokenizer(BPE(vocab=vocab, merges=merges))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
assert tok.get_vocab_size() == 50257
texts = [json.loads(line)["text"] for line in open(sys.argv[3], encoding="utf-8")]
eod = np.array([vocab["<|endoftext|>"]], dtype=np.uint16)
seconds, n = 0.0, 0
with open(sys.argv[4], "wb") as out:
    for i in range(0, len(texts), 256):  # batches bound the memory of Encoding objects
        start = time.perf_counter()
        encodings = tok.encode_batch(texts[i : i + 256], add_special_tokens=False)
        seconds += time.perf_counter() - start
        for e in encodings:
            n += len(e.ids)
            if e.ids:
                out.write(np.concatenate([np.array(e.ids, dtype=np.uint16), eod]).tobytes())
print(n, seconds)
"""


def run_hf_encode_batch(corpus: str, threads: int, expected_bin: str) -> float:
    """tokens/s of HF tokenizers encode_batch with ``threads`` threads (texts already loaded).

    Also writes the .bin that Megatron-DeepSpeed's loop would make from those ids (EOD after
    each non-empty document) to ``expected_bin``, to check the tool's output against.
    """
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), RAYON_RS_NUM_CPUS=str(threads),
               TOKENIZERS_PARALLELISM="true")
    cmd = [sys.executable, "-c", _HF_SNIPPET, VOCAB, MERGES, corpus, expected_bin]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]) / float(out[1])


def same_file(a: str, b: str) -> bool:
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            block = fa.read(16 << 20)
            if block != fb.read(16 << 20):
                return False
            if not block:
                return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20,100", help="corpus sizes in MB, comma separated")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if not all(os.path.isfile(p) for p in [VOCAB, MERGES, *WIKITEXT]):
        print(f"needs the GPT-2 files and WikiText-2 under {SHARED}", file=sys.stderr)
        return 1
    articles = wikitext_articles()
    print(f"{len(articles)} WikiText-2 articles; {args.workers} workers / threads; "
          f"reference Megatron-DeepSpeed: {MDS_WHOLE_TOKENS_PER_S:,} tokens/s whole process, "
          f"{MDS_LOOP_TOKENS_PER_S:,} in its loop (20 MB)")
    with tempfile.TemporaryDirectory() as tmp:
        for size in [float(s) for s in args.sizes.split(",")]:
            corpus = os.path.join(tmp, f"wiki_{size:g}mb.jsonl")
            nbytes = write_corpus(corpus, articles, size)
            ours = run_tool(corpus, os.path.join(tmp, f"out_{size:g}"), args.workers)
            expected = os.path.join(tmp, "out_expected.bin")
            hf = run_hf_encode_batch(corpus, args.workers, expected)
            identical = same_file(os.path.join(tmp, f"out_{size:g}_text_document.bin"), expected)
            whole = ours["tokens"] / ours["wall"]
            print(f"\n{nbytes / 2**20:.1f} MB, {ours['tokens']:,} tokens")
            print(f"  preprocess_data.py whole process: {ours['wall']:.2f} s "
                  f"(start-up {ours['startup']:.2f} s), {whole:,.0f} tokens/s, "
                  f"{nbytes / 2**20 / ours['wall']:.2f} MB/s")
            print(f"  preprocess_data.py in loop:       {ours['loop_tokens_per_s']:,} tokens/s")
            print(f"  HF tokenizers encode_batch:       {hf:,.0f} tokens/s")
            print(f"  ratios: whole / M-DS whole {whole / MDS_WHOLE_TOKENS_PER_S:.2f}x, "
                  f"loop / M-DS loop {ours['loop_tokens_per_s'] / MDS_LOOP_TOKENS_PER_S:.2f}x, "
                  f"whole / HF encode_batch {whole / hf:.2f}x")
            print(f"  .bin identical to HF ids + EOD (Megatron-DeepSpeed's layout): {identical}")
            for name in os.listdir(tmp):
                if name.startswith("out_"):
                    os.remove(os.path.join(tmp, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

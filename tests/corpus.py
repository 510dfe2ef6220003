"""A small real-token corpus for training tests: WikiText-2 through the GPT-2 tokenizer.

Built once per test session into a temporary folder. Without ../shared/data (a user's own
checkout), falls back to random token documents of GPT-2's vocabulary size, so tests still run.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
VOCAB = SHARED / "gpt2" / "gpt2-vocab.json"
MERGES = SHARED / "gpt2" / "gpt2-merges.txt"
WIKITEXT = SHARED / "wikitext-2"


def have_gpt2_files() -> bool:
    return VOCAB.is_file() and MERGES.is_file()


def wikitext_articles(split: str = "valid", max_chars: int = 400_000) -> list[str]:
    """WikiText-2 cut into articles at its top-level ' = Title = ' headings."""
    text = (WIKITEXT / f"{split}.txt").read_text(encoding="utf-8")[:max_chars]
    articles, current = [], []
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("= ") and not stripped.startswith("= =") and current:
            articles.append("".join(current))
            current = []
        current.append(line)
    if current:
        articles.append("".join(current))
    return [a for a in articles if a.strip()]


def build_corpus(out_dir: str, max_chars: int = 400_000) -> dict:
    """Write ``{out_dir}/corpus_text_document.{bin,idx}``; return the flags to train on it."""
    from megatron.data.indexed_dataset import make_builder

    prefix = os.path.join(out_dir, "corpus_text_document")
    builder = make_builder(prefix + ".bin", vocab_size=50257)
    if have_gpt2_files() and (WIKITEXT / "valid.txt").is_file():
        from megatron.tokenizer import build_tokenizer

        tok = build_tokenizer("GPT2BPETokenizer", str(VOCAB), str(MERGES))
        for article in wikitext_articles(max_chars=max_chars):
            ids = np.asarray(tok.tokenize(article) + [tok.eod], dtype=np.int64)
            builder.add_doc(ids, [len(ids)])
        tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(VOCAB),
                           "--merge-file", str(MERGES)]
    else:
        rng = np.random.default_rng(0)
        for _ in range(200):
            ids = rng.integers(0, 50256, int(rng.integers(50, 800)), dtype=np.int64)
            builder.add_doc(ids, [len(ids)])
        tokenizer_flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50256"]
    builder.finalize(prefix + ".idx")
    return {"prefix": prefix, "tokenizer_flags": tokenizer_flags}

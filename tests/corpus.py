"""A small real-token corpus for training tests: WikiText-2 through the GPT-2 tokenizer.

Built once per test module into a temporary folder. Without ../shared/data (a user's own
checkout, or a copy of the repository on another machine; tests/shared_data.py says where it
is looked for), it falls back to Python's own
documentation through a byte-level BPE trained on it: real text, which a model learns from.
(Random tokens, the earlier fallback, cannot be learned: tests that check the loss falls
failed wherever ../shared was missing.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.shared_data import MERGES, VOCAB, WIKITEXT, have_gpt2_files, have_wikitext


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
    if have_gpt2_files() and have_wikitext():
        from megatron.tokenizer import build_tokenizer

        tok = build_tokenizer("GPT2BPETokenizer", str(VOCAB), str(MERGES))
        for article in wikitext_articles(max_chars=max_chars):
            ids = np.asarray(tok.tokenize(article) + [tok.eod], dtype=np.int64)
            builder.add_doc(ids, [len(ids)])
        tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(VOCAB),
                           "--merge-file", str(MERGES)]
    else:
        tokenizer_flags = _python_doc_fallback(builder, out_dir, max_chars)
    builder.finalize(prefix + ".idx")
    return {"prefix": prefix, "tokenizer_flags": tokenizer_flags}


def _python_doc_fallback(builder, out_dir: str, max_chars: int) -> list[str]:
    """Add Python's documentation to ``builder`` as tokens of a BPE trained on it; return the
    tokenizer flags."""
    from megatron.tokenizer import build_tokenizer
    from tests.distributed.training_utils import load_tool

    tool = load_tool("build_quickstart_corpus")
    texts = list(tool.python_doc_documents(max_chars=max_chars))
    vocab, merges = tool.train_tokenizer(texts, Path(out_dir) / "tokenizer", 4096)
    tok = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    for text in texts:
        ids = np.asarray(tok.tokenize(text) + [tok.eod], dtype=np.int64)
        builder.add_doc(ids, [len(ids)])
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
            "--merge-file", str(merges)]

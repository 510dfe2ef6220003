"""Inputs of the zero-shot evaluation tests: a 512-id BPE trained on WikiText-2 (or, without
../shared, on Python's documentation), a WikiText-format text file, and a LAMBADA-format
JSONL file built so that a given model gets some answers right."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from tests.corpus import wikitext_articles
from tests.distributed.training_utils import load_tool
from tests.shared_data import have_wikitext


def texts(max_chars: int = 120_000) -> list[str]:
    """WikiText-2's validation articles, or Python's documentation without ../shared."""
    if have_wikitext():
        return wikitext_articles(max_chars=max_chars)
    return list(load_tool("build_quickstart_corpus").python_doc_documents(max_chars=max_chars))


def train_tokenizer(corpus: list[str], out_dir: Path):
    """(tokenizer, its pretrain_gpt.py flags)."""
    from megatron.tokenizer import build_tokenizer

    vocab, merges = load_tool("build_quickstart_corpus").train_tokenizer(corpus, out_dir, 512)
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
             "--merge-file", str(merges)]
    return build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges)), flags


def write_wikitext(path: Path, corpus: list[str], chars: int) -> None:
    path.write_text("".join(corpus)[:chars], encoding="utf-8")


def write_lambada(path: Path, corpus: list[str], tok, next_token: Callable[[list[int]], int],
                  max_tokens: int, count: int = 60) -> None:
    """Short sentences of ``corpus``; where the model's greedy next token after all but the
    last word (``next_token(ids)``) is a whole word, the sentence ends with that word
    instead, so some answers are right and others wrong."""
    text = " ".join(corpus)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?]) ", text)
                 if 4 <= len(s.split()) <= 12 and len(tok.tokenize(s)) < max_tokens][:count]
    lines = []
    for s in sentences:
        context = " ".join(s.split()[:-1])
        piece = tok.detokenize([next_token(tok.tokenize(context))])
        if piece.startswith(" ") and piece[1:].isalpha():
            s = context + piece
        lines.append(json.dumps({"text": s}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

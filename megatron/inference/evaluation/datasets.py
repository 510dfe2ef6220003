"""The zero-shot datasets: WikiText windows for perplexity, LAMBADA examples for accuracy.

Each item is ``{"text": int64 [seq_length + 1], "pad_mask": float32 [seq_length]}``: the
tokens of one window and, per target position (``text[1:]``), 1 where that target is scored.
Items are padded to ``seq_length + 1`` with ``pad_id`` (mask 0), so every micro-batch has
the shape the pipeline stages exchange.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from megatron.inference.evaluation.detokenizer import detokenizer_for
from megatron.platform.output import print_rank_0


class EvaluationDataError(ValueError):
    """An evaluation data file cannot be read; the message names the file (and line)."""


def _item(tokens: list[int], scored: np.ndarray, seq_length: int, pad_id: int) -> dict:
    """Pad ``tokens`` (at most ``seq_length + 1``) and the per-target mask ``scored``."""
    text = np.full(seq_length + 1, pad_id, dtype=np.int64)
    text[:len(tokens)] = tokens
    mask = np.zeros(seq_length, dtype=np.float32)
    mask[:len(scored)] = scored
    return {"text": text, "pad_mask": mask}


class WindowedLMDataset:
    """Windows of ``seq_length`` targets over one long token stream, ``stride`` apart
    (``--overlapping-eval``). The first window scores all its targets; each later one scores
    only its last ``stride`` targets, which it predicts with up to ``seq_length - stride``
    tokens of context already seen. Every target (tokens ``1 .. n-1``) is scored exactly
    once."""

    def __init__(self, tokens: list[int], seq_length: int, stride: int, pad_id: int,
                 num_original_tokens: int) -> None:
        if not 1 <= stride <= seq_length:
            raise EvaluationDataError(f"--overlapping-eval {stride} must be between 1 and "
                                      f"--seq-length ({seq_length})")
        if len(tokens) < 2:
            raise EvaluationDataError("the text holds fewer than 2 tokens: nothing to score")
        self.tokens, self.seq_length, self.stride, self.pad_id = tokens, seq_length, stride, pad_id
        self.num_tokenized_tokens = len(tokens)
        self.num_original_tokens = num_original_tokens
        targets = len(tokens) - 1
        # Window i covers targets i*stride+1 .. i*stride+seq_length.
        self.num_windows = max(math.ceil((targets - seq_length) / stride), 0) + 1

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, idx: int) -> dict:
        start = idx * self.stride
        window = self.tokens[start:start + self.seq_length + 1]
        scored = np.ones(len(window) - 1, dtype=np.float32)
        if idx > 0:
            scored[:self.seq_length - self.stride] = 0.0  # seen by the previous window
        return _item(window, scored, self.seq_length, self.pad_id)


def build_wikitext_dataset(path: str, tokenizer: Any, seq_length: int,
                           stride: int) -> WindowedLMDataset:
    """WikiText (or any text file) as Megatron reads it: whole file, word count by spaces,
    detokenized by the rule for its file name, tokenized as one stream."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise EvaluationDataError(f"--valid-data {path}: cannot read it as UTF-8 text: "
                                  f"{error}") from None
    num_original_tokens = len(text.strip().split(" "))
    name, detokenize = detokenizer_for(path)
    try:
        tokens = tokenizer.tokenize(detokenize(text))
    except ValueError as error:
        raise EvaluationDataError(f"--valid-data {path}: cannot tokenize it: {error}") from None
    print_rank_0(f" > {path}: {num_original_tokens} original tokens, {len(tokens)} "
                 f"tokenized tokens (detokenizer: {name})")
    return WindowedLMDataset(tokens, seq_length, stride, tokenizer.eod, num_original_tokens)


class LambadaDataset:
    """LAMBADA (one ``{"text": ...}`` JSON object per line): predict the last word.

    Non-strict (Megatron's default): the last *token* of the tokenized text is the target.
    Strict (``--strict-lambada``): the whole last whitespace-separated word, tokenized with
    its leading space, must be predicted token by token (teacher forced), from the text
    before it. An example counts as right when the greedy prediction of every target token
    is right.
    """

    def __init__(self, path: str, tokenizer: Any, seq_length: int, strict: bool) -> None:
        self.seq_length, self.pad_id, self.strict = seq_length, tokenizer.eod, strict
        self.examples = []
        for n, text in _read_jsonl_texts(path):
            try:
                self.examples.append(self._split(text, tokenizer, path, n))
            except EvaluationDataError:
                raise
            except ValueError as error:  # the tokenizer's own complaint
                raise EvaluationDataError(f"{path}, line {n}: cannot tokenize it: "
                                          f"{error}") from None
        if not self.examples:
            raise EvaluationDataError(f"--valid-data {path} holds no examples")
        print_rank_0(f" > {path}: {len(self.examples)} LAMBADA examples "
                     f"({'strict' if strict else 'non-strict'})")

    def _split(self, text: str, tokenizer: Any, path: str, line: int):
        if self.strict:
            words = text.split()
            if not words:
                raise EvaluationDataError(f"{path}, line {line}: the text is empty")
            start = text.rfind(words[-1])
            context = tokenizer.tokenize(text[:start].strip())
            target = tokenizer.tokenize(" " + words[-1])
        else:
            tokens = tokenizer.tokenize(text)
            context, target = tokens[:-1], tokens[-1:]
        if not context or not target:
            raise EvaluationDataError(f"{path}, line {line}: too short: it needs context and "
                                      "a last word")
        if len(context) + len(target) > self.seq_length + 1:
            raise EvaluationDataError(
                f"{path}, line {line}: {len(context) + len(target)} tokens, more than "
                f"--seq-length + 1 ({self.seq_length + 1})")
        return context, target

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, idx: int) -> dict:
        context, target = self.examples[idx]
        tokens = context + target
        scored = np.zeros(len(tokens) - 1, dtype=np.float32)
        scored[len(context) - 1:] = 1.0  # the positions whose next token is the target
        return _item(tokens, scored, self.seq_length, self.pad_id)


def _read_jsonl_texts(path: str):
    """(line number, text) of each non-blank line; bad lines are errors naming them."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as error:
        raise EvaluationDataError(f"--valid-data {path}: {error}") from None
    with f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise EvaluationDataError(f"{path}, line {n}: not JSON: {error}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise EvaluationDataError(f'{path}, line {n}: expected {{"text": "..."}}')
            yield n, record["text"]

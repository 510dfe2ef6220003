"""A slow, pure-Python GPT-2 BPE encoder: the reference our compiled backends are checked against.

It follows OpenAI's released algorithm step by step (split with GPT-2's regex, map bytes to
printable characters, merge the best-ranked adjacent pair until none is in merges.txt), the
same algorithm as transformers' old slow GPT2Tokenizer and Megatron's gpt2_tokenization.py.
It knows no special tokens, so ``<|endoftext|>`` in text is encoded as characters.
"""

from __future__ import annotations

import json

import regex

from megatron.tokenizer.gpt2_bpe import bytes_to_unicode

_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


class ReferenceGPT2:
    def __init__(self, vocab_file: str, merge_file: str):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = [ln.split() for ln in f.read().split("\n")[1:] if ln.strip()]
        self.ranks = {tuple(pair): i for i, pair in enumerate(lines)}
        self.byte_map = bytes_to_unicode()
        self.cache: dict[str, list[str]] = {}

    def _bpe(self, word: str) -> list[str]:
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = list(zip(parts, parts[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            # Merge every occurrence of the best pair, left to right.
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in _SPLIT.findall(text):
            word = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[tok] for tok in self._bpe(word))
        return ids

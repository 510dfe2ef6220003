"""The Llama family's tokenizers, read from their own files (``--tokenizer-model FILE``):

    Llama2Tokenizer            a SentencePiece ``tokenizer.model`` (Llama 2, Mistral); each
                               document starts with BOS, as Megatron-LM's does
    GPTSentencePieceTokenizer  the same files without the BOS (Megatron-LM's GPT spelling)
    Llama3Tokenizer            Llama 3's ``tokenizer.model``: tiktoken's BPE ranks (one
                               ``<base64 bytes> <rank>`` line per token), Llama 3's split
                               pattern and its 256 special tokens after the ranks; BOS first

A folder with ``tokenizer.json`` (any of these models as Hugging Face ships them) is
``HuggingFaceTokenizer`` (``tokenizer.PretrainedFromHF``) instead.

The end of a document (``eod``) is the tokenizer's end-of-sequence token (``</s>``,
``<|end_of_text|>``). Text is never read as special tokens: a ``</s>`` or
``<|begin_of_text|>`` inside a document stays text. The ids are the libraries' own
(sentencepiece's, tiktoken's), which tests/unit/tokenizer checks against them and against
Hugging Face's conversion of the same files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from megatron.tokenizer.errors import TokenizerConfigError

# Llama 3's split pattern and special tokens (meta-llama/llama3, tokenizer.py).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
LLAMA3_SPECIAL = (
    ["<|begin_of_text|>", "<|end_of_text|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL - 5)]
)


def _model_file(path: str, kind: str) -> str:
    if not path:
        raise TokenizerConfigError(f"{kind} needs --tokenizer-model (its tokenizer.model file)")
    if not os.path.isfile(path):
        raise TokenizerConfigError(f"--tokenizer-model {path!r} is not a file ({kind} reads "
                                   "its tokenizer.model)")
    return path


class SentencePieceTokenizer:
    """A SentencePiece model; ``add_bos``: each ``tokenize`` starts with the BOS id."""

    def __init__(self, model_file: str, add_bos: bool, kind: str):
        # optional: sentencepiece (only the SentencePiece tokenizer types need it)
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerConfigError(f"{kind} needs the sentencepiece package: pip install "
                                       "sentencepiece") from None
        path = _model_file(model_file, kind)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise TokenizerConfigError(f"--tokenizer-model {path!r}: not a SentencePiece "
                                       f"model ({e})") from None
        if self._sp.eos_id() < 0:
            raise TokenizerConfigError(f"--tokenizer-model {path!r} has no end-of-sentence "
                                       "piece to end documents with")
        if add_bos and self._sp.bos_id() < 0:
            raise TokenizerConfigError(f"--tokenizer-model {path!r} has no beginning-of-"
                                       f"sentence piece, which {kind} starts documents with")
        self._bos = [self._sp.bos_id()] if add_bos else []

    @property
    def vocab_size(self) -> int:
        return int(self._sp.vocab_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected text (str), got {type(text).__name__}")
        return self._bos + self._sp.encode(text)

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenize(text), dtype=np.uint32)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._bos + ids for ids in self._sp.encode(list(texts))] if texts else []

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])  # BOS and EOS decode to nothing


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken BPE file (``<base64 token> <rank>`` per line), checked: ranks 0..n-1, each
    once; a one-line ``error`` naming the file and line otherwise."""
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (IndexError, ValueError, binascii.Error):
                raise TokenizerConfigError(f"--tokenizer-model {path}, line {number}: expected "
                                           "'<base64 token> <rank>'") from None
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerConfigError(f"--tokenizer-model {path}: the ranks are not 0..{len(ranks) - 1}"
                                   " with each token once")
    return ranks


class Llama3Tokenizer:
    """Llama 3's tiktoken BPE; each ``tokenize`` starts with ``<|begin_of_text|>``."""

    def __init__(self, model_file: str):
        import tiktoken

        path = _model_file(model_file, "Llama3Tokenizer")
        ranks = read_tiktoken_ranks(path)
        special = {name: len(ranks) + i for i, name in enumerate(LLAMA3_SPECIAL)}
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=special)
        self._bos, self._eod = special["<|begin_of_text|>"], special["<|end_of_text|>"]
        self._vocab_size = len(ranks) + len(special)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._bos

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected text (str), got {type(text).__name__}")
        return [self._bos, *self._enc.encode_ordinary(text)]

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenize(text), dtype=np.uint32)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self._bos, *ids] for ids in self._enc.encode_ordinary_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) != self._bos])

"""Tokenizer types and ``build_tokenizer``.

Every tokenizer has ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]``,
``tokenize_to_numpy(text) -> uint32 array``, ``tokenize_batch(texts)`` and
``detokenize(ids) -> str``. This module imports neither torch nor transformers at import time,
so tools that only tokenize start quickly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from megatron.tokenizer.errors import TokenizerConfigError
from megatron.tokenizer.gpt2_bpe import BACKENDS, GPT2BPETokenizer
from megatron.tokenizer.llama import Llama3Tokenizer, SentencePieceTokenizer


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and text generation need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_to_numpy(self, text: str) -> np.ndarray: ...

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


GPT2_BPE = "GPT2BPETokenizer"
PRETRAINED_FROM_HF = "PretrainedFromHF"
NULL = "NullTokenizer"
LLAMA2 = "Llama2Tokenizer"
GPT_SENTENCEPIECE = "GPTSentencePieceTokenizer"
LLAMA3 = "Llama3Tokenizer"
MODEL_FILE_TYPES = (LLAMA2, GPT_SENTENCEPIECE, LLAMA3)  # --tokenizer-model names a file

# Spellings used by Megatron-LM, Megatron-DeepSpeed, BigScience and older guides.
_ALIASES = {
    "gpt2bpetokenizer": GPT2_BPE,
    "pretrainedfromhf": PRETRAINED_FROM_HF,
    "hftokenizer": PRETRAINED_FROM_HF,
    "huggingfacetokenizer": PRETRAINED_FROM_HF,
    "hfautotokenizer": PRETRAINED_FROM_HF,
    "nulltokenizer": NULL,
    "llama2tokenizer": LLAMA2,
    "gptsentencepiecetokenizer": GPT_SENTENCEPIECE,
    "llama3tokenizer": LLAMA3,
}


def canonical_tokenizer_type(name: str) -> str:
    """The one spelling of a tokenizer type; raises naming --tokenizer-type if unknown."""
    canonical = _ALIASES.get(str(name).replace("_", "").replace("-", "").lower())
    if canonical is None:
        raise TokenizerConfigError(
            f"--tokenizer-type {name!r} is not supported; choose one of "
            f"{GPT2_BPE}, {PRETRAINED_FROM_HF} (alias HFTokenizer, HuggingFaceTokenizer), "
            f"{LLAMA2}, {GPT_SENTENCEPIECE}, {LLAMA3} or {NULL}"
        )
    return canonical


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer flags; ``tokenizer_type`` is stored in its canonical spelling."""

    tokenizer_type: str
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_name_or_path: Optional[str] = None
    vocab_size: Optional[int] = None  # NullTokenizer only
    backend: str = "auto"  # GPT2BPETokenizer: "auto", "tiktoken" or "tokenizers"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer_type", canonical_tokenizer_type(self.tokenizer_type))
        if self.tokenizer_type == GPT2_BPE:
            _require_file(self.vocab_file, "--vocab-file")
            _require_file(self.merge_file, "--merge-file")
            if self.backend not in BACKENDS:
                raise TokenizerConfigError(f"tokenizer backend must be one of {BACKENDS}")
        elif self.tokenizer_type == PRETRAINED_FROM_HF:
            path = self.tokenizer_name_or_path
            if not path:
                raise TokenizerConfigError(f"{PRETRAINED_FROM_HF} needs --tokenizer-name-or-path")
            if not os.path.isdir(path):
                raise TokenizerConfigError(
                    f"--tokenizer-name-or-path {path!r} is not a local directory "
                    "(tokenizers are loaded offline)"
                )
        elif self.tokenizer_type in MODEL_FILE_TYPES:
            path = self.tokenizer_name_or_path
            if not path:
                raise TokenizerConfigError(f"{self.tokenizer_type} needs --tokenizer-model "
                                           "(its tokenizer.model file)")
            if not os.path.isfile(path):
                raise TokenizerConfigError(f"--tokenizer-model {path!r} is not a file "
                                           f"({self.tokenizer_type} reads its tokenizer.model)")
        elif self.tokenizer_type == NULL:
            if self.vocab_size is None or int(self.vocab_size) <= 0:
                raise TokenizerConfigError(f"{NULL} needs a positive --vocab-size")
            object.__setattr__(self, "vocab_size", int(self.vocab_size))


def _require_file(path: Optional[str], flag: str) -> None:
    if not path:
        raise TokenizerConfigError(f"{GPT2_BPE} needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerConfigError(f"{flag} {path!r} does not exist or is not a file")


def build_tokenizer(
    tokenizer_type: str | TokenizerConfig,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_name_or_path: Optional[str] = None,
    vocab_size: Optional[int] = None,
    backend: str = "auto",
) -> Tokenizer:
    """Build the tokenizer named by ``tokenizer_type`` (or described by a TokenizerConfig)."""
    if isinstance(tokenizer_type, TokenizerConfig):
        config = tokenizer_type
    else:
        config = TokenizerConfig(
            tokenizer_type, vocab_file, merge_file, tokenizer_name_or_path, vocab_size, backend
        )
    if config.tokenizer_type == GPT2_BPE:
        return GPT2BPETokenizer(config.vocab_file, config.merge_file, backend=config.backend)
    if config.tokenizer_type == PRETRAINED_FROM_HF:
        return PretrainedFromHF(config.tokenizer_name_or_path)
    if config.tokenizer_type in (LLAMA2, GPT_SENTENCEPIECE):
        return SentencePieceTokenizer(config.tokenizer_name_or_path,
                                      add_bos=config.tokenizer_type == LLAMA2,
                                      kind=config.tokenizer_type)
    if config.tokenizer_type == LLAMA3:
        return Llama3Tokenizer(config.tokenizer_name_or_path)
    return NullTokenizer(config.vocab_size)


class NullTokenizer:
    """Text is space-separated token ids; ``eod`` is the given vocab size (Megatron-LM).

    ``vocab_size`` is one more than the given size so that the EOD id is in range.
    """

    def __init__(self, vocab_size: int):
        self._eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected text (str), got {type(text).__name__}")
        try:
            ids = [int(tok) for tok in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer expects space-separated integers: {e}") from None
        for i in ids:
            if not 0 <= i < self._eod:
                raise ValueError(f"NullTokenizer id {i} is outside [0, {self._eod})")
        return ids

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenize(text), dtype=np.uint32)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class PretrainedFromHF:
    """A Hugging Face tokenizer loaded offline from a local directory.

    ``tokenize`` adds the tokenizer's own special tokens (a BOS for Llama, say), as
    Megatron-DeepSpeed's HF tokenizer does, but never parses special-token text inside the
    input: a literal ``</s>`` in a document stays text.
    """

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise TokenizerConfigError(
                f"--tokenizer-name-or-path {name_or_path!r}: cannot load a tokenizer: {e}"
            ) from e
        if self._tokenizer.eos_token_id is None:
            raise TokenizerConfigError(
                f"--tokenizer-name-or-path {name_or_path!r}: the tokenizer has no EOS token "
                "to use as end of document"
            )
        self._vocab_size = len(self._tokenizer)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return int(self._tokenizer.eos_token_id)

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected text (str), got {type(text).__name__}")
        return list(self._tokenizer(text, split_special_tokens=True)["input_ids"])

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenize(text), dtype=np.uint32)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [
            list(ids)
            for ids in self._tokenizer(list(texts), split_special_tokens=True)["input_ids"]
        ]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

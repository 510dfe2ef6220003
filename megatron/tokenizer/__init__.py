"""Tokenizers: GPT-2 BPE (GPT-2's exact ids), Hugging Face (local, offline), the Llama family's
(SentencePiece, Llama 3's tiktoken BPE), Null (ids as text)."""

from megatron.tokenizer.errors import LoneSurrogateError, TokenizerConfigError, TokenizerFileError
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.llama import Llama3Tokenizer, SentencePieceTokenizer
from megatron.tokenizer.tokenizer import (
    NullTokenizer,
    PretrainedFromHF,
    Tokenizer,
    TokenizerConfig,
    build_tokenizer,
    canonical_tokenizer_type,
)

__all__ = [
    "GPT2BPETokenizer",
    "Llama3Tokenizer",
    "LoneSurrogateError",
    "NullTokenizer",
    "PretrainedFromHF",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "TokenizerConfigError",
    "TokenizerFileError",
    "build_tokenizer",
    "canonical_tokenizer_type",
]

"""GPT-2 byte-level BPE from a vocab.json + merges.txt pair, with a compiled backend.

Token ids are exactly those of OpenAI's GPT-2 encoder (and of Megatron's GPT2BPETokenizer).
Text is always ordinary text: a literal ``<|endoftext|>`` in the input is encoded as its
characters; only the caller appends the end-of-document id.

Two compiled backends give the same ids:

- ``tiktoken`` (preferred, several times faster): an ``Encoding`` built in memory from the
  files, never downloaded.
- HF ``tokenizers``: a ByteLevel BPE model built from the same vocab and merges, with the
  GPT-2 split regex and no added tokens, so nothing is parsed as a special token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megatron.tokenizer.errors import LoneSurrogateError, TokenizerFileError

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other symbol runs (each with an
# optional leading space), then whitespace that is not followed by a non-space, then the rest.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

BACKENDS = ("auto", "tiktoken", "tokenizers")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character.

    Printable Latin-1 bytes map to themselves; the rest (controls, space, soft hyphen...)
    map to code points from 256 upwards, in byte order.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@dataclass(frozen=True)
class GPT2Files:
    """The parsed contents of a GPT-2 vocab/merges pair."""

    vocab: dict[str, int]  # byte-level token string -> id
    merges: list[tuple[str, str]]  # in priority order
    vocab_file: str
    merge_file: str


def _require_file(path: str | None, flag: str) -> str:
    if not path:
        raise TokenizerFileError(f"GPT2BPETokenizer needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerFileError(f"{flag} {path!r} does not exist or is not a file")
    return path


def load_gpt2_files(vocab_file: str | None, merge_file: str | None) -> GPT2Files:
    """Read and check a GPT-2 ``vocab.json`` and ``merges.txt``; errors name the file."""
    vocab_file = _require_file(vocab_file, "--vocab-file")
    merge_file = _require_file(merge_file, "--merge-file")
    vocab = _read_vocab(vocab_file)
    return GPT2Files(vocab, _read_merges(merge_file, vocab, vocab_file), vocab_file, merge_file)


def _read_vocab(vocab_file: str) -> dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerFileError(f"--vocab-file {vocab_file!r} is not valid JSON: {e}") from e
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerFileError(f"--vocab-file {vocab_file!r} must map token strings to ids")
    if EOD_TOKEN not in vocab:
        raise TokenizerFileError(f"--vocab-file {vocab_file!r} has no {EOD_TOKEN} token")
    return vocab


def _read_merges(merge_file: str, vocab: dict[str, int], vocab_file: str) -> list[tuple[str, str]]:
    """The merges in priority order. Each makes a token of the vocabulary, so a file cut
    mid-line (or one from another vocabulary) is refused rather than tokenizing differently."""
    with open(merge_file, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_number = raw.count(b"\n", 0, e.start) + 1
        raise TokenizerFileError(
            f"--merge-file {merge_file!r} line {line_number}: not UTF-8 text ({e.reason} at "
            f"byte {e.start}); is it a GPT-2 merges.txt, complete?") from None
    lines = text.split("\n")
    merges = []
    for line_number, line in enumerate(lines, start=1):
        if line.startswith("#version") or not line.strip():
            continue
        # A last line without its newline is where a copy cut short would end.
        cut = "; the file ends mid-line (cut short?)" if line_number == len(lines) else ""
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerFileError(
                f"--merge-file {merge_file!r} line {line_number}: expected two tokens, "
                f"got {line.rstrip()!r}{cut}"
            )
        if parts[0] + parts[1] not in vocab:
            raise TokenizerFileError(
                f"--merge-file {merge_file!r} line {line_number}: the merge {line.rstrip()!r} "
                f"makes {parts[0] + parts[1]!r}, which --vocab-file {vocab_file!r} does not "
                f"hold{cut or '; is the merges file from another vocabulary?'}"
            )
        merges.append((parts[0], parts[1]))
    return merges


def mergeable_ranks(files: GPT2Files) -> dict[bytes, int] | None:
    """tiktoken ranks (token bytes -> id), or None when tiktoken would not give GPT-2's ids.

    tiktoken merges the adjacent pair whose concatenation has the lowest id, while GPT-2
    merges the pair listed first in merges.txt. The two agree when the 256 single bytes come
    first and merge number i creates id 256 + i, which holds for GPT-2's own files.
    """
    decode = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for token, token_id in files.vocab.items():
        if token == EOD_TOKEN:
            continue
        if any(c not in decode for c in token):
            return None
        ranks[bytes(decode[c] for c in token)] = token_id
    singles = sorted(ranks[bytes([b])] for b in range(256) if bytes([b]) in ranks)
    if singles != list(range(256)):
        return None
    for i, (left, right) in enumerate(files.merges):
        if files.vocab.get(left + right) != 256 + i:
            return None
    if len(ranks) != 256 + len(files.merges):
        return None
    return ranks


class _TiktokenBackend:
    name = "tiktoken"

    def __init__(self, files: GPT2Files, ranks: dict[bytes, int]):
        import tiktoken

        self._encoding = tiktoken.Encoding(
            name=f"gpt2-bpe:{os.path.abspath(files.vocab_file)}",
            pat_str=GPT2_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            # Registered only so that decode can print it; encode never parses it.
            special_tokens={EOD_TOKEN: files.vocab[EOD_TOKEN]},
            explicit_n_vocab=len(files.vocab),
        )

    def encode(self, text: str) -> list[int]:
        return self.encode_to_numpy(text).tolist()

    def encode_to_numpy(self, text: str) -> np.ndarray:
        # An empty allowed set makes the compiled encoder treat special tokens as plain text
        # (tiktoken's encode_ordinary would also do so, but silently replaces lone surrogates).
        return self._encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids), errors="replace")


class _TokenizersBackend:
    name = "tokenizers"

    def __init__(self, files: GPT2Files):
        from tokenizers import Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        tokenizer = Tokenizer(BPE(vocab=dict(files.vocab), merges=list(files.merges)))
        # ByteLevel's built-in split regex is GPT-2's; no added tokens, so nothing is special.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        if tokenizer.get_vocab_size() != len(files.vocab):
            raise TokenizerFileError(
                f"tokenizers built {tokenizer.get_vocab_size()} tokens from --vocab-file "
                f"{files.vocab_file!r}, expected {len(files.vocab)}"
            )
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_to_numpy(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def _encode_checked(encode, text: str):
    # GPT-2's reference encoder cannot encode such text either; rather than guess a
    # replacement, the caller gets an error it can report with the input's file and line.
    if not isinstance(text, str):
        raise TypeError(f"expected text (str), got {type(text).__name__}")
    try:
        return encode(text)
    except (UnicodeEncodeError, TypeError) as e:
        raise LoneSurrogateError("text contains a lone surrogate (not valid Unicode)") from e


class GPT2BPETokenizer:
    """GPT-2 BPE tokenizer; ``vocab_size`` 50257 and ``eod`` 50256 for GPT-2's files."""

    def __init__(self, vocab_file: str | None, merge_file: str | None, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        files = load_gpt2_files(vocab_file, merge_file)
        self._files = files
        self._eod = files.vocab[EOD_TOKEN]
        self._backend = self._build_backend(files, backend)

    @staticmethod
    def _build_backend(files: GPT2Files, backend: str):
        if backend in ("auto", "tiktoken"):
            ranks = mergeable_ranks(files)
            if ranks is None and backend == "tiktoken":
                raise TokenizerFileError(
                    f"tiktoken cannot reproduce the merge order of {files.merge_file!r}; "
                    "use the tokenizers backend"
                )
            try:
                if ranks is not None:
                    return _TiktokenBackend(files, ranks)
            except ImportError:
                if backend == "tiktoken":
                    raise
        return _TokenizersBackend(files)

    @property
    def backend(self) -> str:
        """Which compiled encoder is in use: ``"tiktoken"`` or ``"tokenizers"``."""
        return self._backend.name

    @property
    def vocab_size(self) -> int:
        return len(self._files.vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._files.vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self._files.vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; raises LoneSurrogateError for text with no UTF-8 form."""
        return _encode_checked(self._backend.encode, text)

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as a uint32 array, without building a Python list."""
        return _encode_checked(self._backend.encode_to_numpy, text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, in order (single-threaded: workers are processes)."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode(ids)

"""The data slice: where training tokens come from, how they are split, and the tokenizer.

``--data-path`` and ``--split`` are parsed by the data layer's own parsers
(``megatron.data.dataset_utils.parse_data_path`` / ``parse_split``), the same functions the
dataset builders and ``tools/build_index_cache.py`` use, so every entry point reads them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config.base import (
    ConfigError,
    Slice,
    as_tuples,
    flag,
    non_negative,
    one_of,
    option,
    optional_positive,
    require,
    set_field,
)
from megatron.data.dataset_utils import (
    DEFAULT_SPLIT,
    DataConfigError,
    parse_data_path,
    parse_split,
)
from megatron.tokenizer.errors import TokenizerConfigError
from megatron.tokenizer.tokenizer import canonical_tokenizer_type as canonical

_PATHS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
_PATH_HELP = "one dataset prefix (no .bin/.idx), or WEIGHT PREFIX pairs to blend"

Blend = tuple[tuple[str, ...], Optional[tuple[float, ...]]]


def canonical_tokenizer_type(name: str) -> str:
    """--tokenizer-type in the tokenizer package's one spelling (forks' aliases accepted)."""
    try:
        return canonical(name)
    except TokenizerConfigError as error:
        raise ConfigError(str(error)) from None


DATA_IMPLS = ("mmap", "infer", "lazy", "cached", "flat", "npy")
_PREFIX_IMPLS = ("mmap", "lazy", "cached")  # formats named by a .bin/.idx prefix


def parse_blend(flag_name: str, tokens: Optional[tuple[str, ...]],
                data_impl: str = "mmap") -> Optional[Blend]:
    """``--data-path`` tokens -> (prefixes, weights); weights None for one prefix."""
    try:
        parsed = parse_data_path(tokens, flag_name) if tokens else None
    except DataConfigError as error:
        raise ConfigError(str(error)) from None
    if parsed is None:
        return None
    prefixes, weights = parsed
    for prefix in prefixes if data_impl in _PREFIX_IMPLS else ():
        require(not prefix.endswith((".bin", ".idx")),
                f"{flag_name}: give the dataset prefix without .bin/.idx, got {prefix!r}")
    return tuple(prefixes), None if weights is None else tuple(weights)


def split_fractions(split: str) -> tuple[float, float, float]:
    """``--split`` as train/valid/test fractions summing to 1."""
    try:
        weights = parse_split(split)
    except DataConfigError as error:
        raise ConfigError(str(error)) from None
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


@dataclass(frozen=True)
class DataConfig(Slice):
    """Where the training tokens come from, and how they are split and tokenized."""

    data_path: Optional[tuple[str, ...]] = option(
        nargs="*", default=None, help=f"Training data: {_PATH_HELP}; split by --split.")
    train_data_path: Optional[tuple[str, ...]] = option(
        nargs="*", default=None, help=f"Training data of its own: {_PATH_HELP}.")
    valid_data_path: Optional[tuple[str, ...]] = option(
        nargs="*", default=None, help=f"Validation data of its own: {_PATH_HELP}.")
    test_data_path: Optional[tuple[str, ...]] = option(
        nargs="*", default=None, help=f"Test data of its own: {_PATH_HELP}.")
    mock_data: bool = option(default=False, help="Synthetic tokens instead of files (wins "
                             "over any path).")
    split: str = option(default=DEFAULT_SPLIT, help="train, valid, test proportions of "
                        "--data-path's documents.")
    data_impl: str = option(default="mmap", choices=DATA_IMPLS,
                            help="Dataset format: mmap (Megatron's .bin/.idx); lazy or cached "
                            "(Megatron's legacy TNTIDX pair, read per sequence or all in RAM); "
                            "flat (nanoGPT train.bin/val.bin uint16, llm.c shards) or npy "
                            "(FineWeb .npy shards): a file, glob or folder; infer tells them "
                            "apart from the .idx magic and the file names.")
    in_memory: bool = option("--in-memory", "--no-mmap-bin-files", default=False,
                             help="Read the dataset's tokens into RAM at start-up instead of "
                             "memory-mapping them.")
    mmap_warmup: bool = option(default=False, help="Read the memory-mapped index once at "
                               "start-up to warm the page cache.")
    data_cache_path: Optional[str] = option(
        default=None, help="Folder for the index caches (*_doc_idx.npy, ...); beside the data "
        "when unset.")
    dataloader_type: str = option(default="single", choices=("single", "cyclic"),
                                  help="single: one pass in order; cyclic: shuffled epochs.")
    num_workers: int = option(default=2, help="DataLoader worker processes per rank.")
    tokenizer_type: str = option(
        default="GPT2BPETokenizer", help="GPT2BPETokenizer, PretrainedFromHF (alias "
        "HFTokenizer, HuggingFaceTokenizer), Llama2Tokenizer, GPTSentencePieceTokenizer, "
        "Llama3Tokenizer or NullTokenizer.")
    vocab_file: Optional[str] = option("--vocab-file", "--vocab", default=None,
                                       help="GPT-2 vocab.json.")
    merge_file: Optional[str] = option(default=None, help="GPT-2 merges.txt.")
    tokenizer_name_or_path: Optional[str] = option(
        "--tokenizer-name-or-path", "--tokenizer-model", default=None,
        help="Local Hugging Face tokenizer folder (PretrainedFromHF), or the tokenizer.model "
        "file of Llama2Tokenizer, GPTSentencePieceTokenizer and Llama3Tokenizer.")
    vocab_size: Optional[int] = option(default=None, help="NullTokenizer's vocabulary size.")
    reset_position_ids: bool = option(default=False, help="Restart position ids after each "
                                      "end-of-document token.")
    reset_attention_mask: bool = option(default=False, help="Do not attend across "
                                        "end-of-document tokens.")
    eod_mask_loss: bool = option(default=False, help="No loss on end-of-document tokens.")

    def __post_init__(self) -> None:
        as_tuples(self, *_PATHS)
        for name in _PATHS:
            parse_blend(flag(name), getattr(self, name), self.data_impl)
        require(not (self.data_path and any(getattr(self, n) for n in _PATHS[1:])),
                "--data-path and --train-data-path/--valid-data-path/--test-data-path are "
                "mutually exclusive")
        split_fractions(self.split)
        set_field(self, "tokenizer_type", canonical_tokenizer_type(self.tokenizer_type))
        one_of(self, "data_impl", DATA_IMPLS)
        one_of(self, "dataloader_type", ("single", "cyclic"))
        non_negative(self, "num_workers")
        optional_positive(self, "vocab_size")

    @property
    def blend(self) -> Optional[Blend]:
        """(prefixes, weights) of --data-path, or None."""
        return parse_blend("--data-path", self.data_path, self.data_impl)

    @property
    def blend_per_split(self) -> tuple[Optional[Blend], Optional[Blend], Optional[Blend]]:
        """(train, valid, test) blends of the per-split paths; None where not given."""
        return tuple(parse_blend(flag(n), getattr(self, n), self.data_impl)  # type: ignore
                     for n in _PATHS[1:])

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        return split_fractions(self.split)

    @property
    def has_data_source(self) -> bool:
        return self.mock_data or bool(self.data_path) or any(self.blend_per_split)

    def tokenizer_inputs_missing(self) -> list[str]:
        """The flags this tokenizer type needs and did not get."""
        needs = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
                 "PretrainedFromHF": ("tokenizer_name_or_path",),
                 "Llama2Tokenizer": ("tokenizer_name_or_path",),
                 "GPTSentencePieceTokenizer": ("tokenizer_name_or_path",),
                 "Llama3Tokenizer": ("tokenizer_name_or_path",),
                 "NullTokenizer": ("vocab_size",)}[self.tokenizer_type]
        return [f"{flag(n)} (for --tokenizer-type {self.tokenizer_type})"
                for n in needs if getattr(self, n) is None]

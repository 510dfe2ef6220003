"""build_tokenizer: type spellings, NullTokenizer, and PretrainedFromHF from a local directory."""

import json

import pytest

from megatron.tokenizer import (
    NullTokenizer,
    TokenizerConfig,
    TokenizerConfigError,
    build_tokenizer,
    canonical_tokenizer_type,
)
from tests.unit.tokenizer.gpt2_reference import ReferenceGPT2
from tests.unit.tokenizer.strings import VARIED_STRINGS


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("GPT2BPETokenizer", "GPT2BPETokenizer"),
        ("PretrainedFromHF", "PretrainedFromHF"),
        ("HFTokenizer", "PretrainedFromHF"),
        ("HuggingFaceTokenizer", "PretrainedFromHF"),
        ("HFAutoTokenizer", "PretrainedFromHF"),
        ("NullTokenizer", "NullTokenizer"),
    ],
)
def test_type_spellings(spelling, canonical):
    assert canonical_tokenizer_type(spelling) == canonical


def test_unknown_type_names_the_flag():
    with pytest.raises(TokenizerConfigError, match="--tokenizer-type 'BertWordPiece'"):
        canonical_tokenizer_type("BertWordPiece")


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.eod == 100 and tok.vocab_size == 101
    assert tok.tokenize("1 2  99\n3") == [1, 2, 99, 3]
    assert tok.tokenize("") == []
    assert tok.detokenize([4, 5]) == "4 5"
    assert tok.tokenize_to_numpy("7 8").tolist() == [7, 8]
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("1 two")


def test_null_tokenizer_needs_vocab_size():
    with pytest.raises(TokenizerConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_hf_needs_a_local_directory(tmp_path):
    with pytest.raises(TokenizerConfigError, match="--tokenizer-name-or-path"):
        TokenizerConfig("HFTokenizer")
    with pytest.raises(TokenizerConfigError, match="not a local directory"):
        TokenizerConfig("HFTokenizer", tokenizer_name_or_path="gpt2")  # a hub name: offline


@pytest.fixture(scope="module")
def hf_gpt2_dir(gpt2_files, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file = gpt2_files
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line.strip()]
    hf = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
    # transformers 5 builds an empty vocab from vocab_file=/merges_file=; make sure we did not.
    assert len(hf) == 50257
    path = tmp_path_factory.mktemp("hf_gpt2")
    hf.save_pretrained(str(path))
    return str(path)


def test_pretrained_from_hf_matches_gpt2_bpe(hf_gpt2_dir, gpt2_files):
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_name_or_path=hf_gpt2_dir)
    bpe = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    reference = ReferenceGPT2(*gpt2_files)
    assert hf.vocab_size == bpe.vocab_size == 50257
    assert hf.eod == bpe.eod == 50256
    for text in VARIED_STRINGS:
        assert hf.tokenize(text) == bpe.tokenize(text) == reference.encode(text), text
    assert hf.tokenize_batch(VARIED_STRINGS) == [bpe.tokenize(t) for t in VARIED_STRINGS]
    assert hf.tokenize("<|endoftext|>") != [hf.eod]
    assert hf.detokenize(hf.tokenize("Hello world")) == "Hello world"


def test_transformers_gpt2_agrees_with_reference(hf_gpt2_dir, gpt2_files):
    # The HF reference itself, used with special-token parsing off.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(hf_gpt2_dir, local_files_only=True)
    reference = ReferenceGPT2(*gpt2_files)
    for text in VARIED_STRINGS:
        assert hf(text, split_special_tokens=True)["input_ids"] == reference.encode(text), text

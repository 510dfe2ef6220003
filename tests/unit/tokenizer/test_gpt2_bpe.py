"""GPT2BPETokenizer gives GPT-2's exact ids on both compiled backends."""

import json
import os
import sys

import numpy as np
import pytest

from megatron.tokenizer import (
    GPT2BPETokenizer,
    LoneSurrogateError,
    TokenizerConfigError,
    TokenizerFileError,
    build_tokenizer,
)
from megatron.tokenizer.gpt2_bpe import EOD_TOKEN, bytes_to_unicode
from tests.shared_data import WIKITEXT_VALID, missing
from tests.unit.tokenizer.gpt2_reference import ReferenceGPT2
from tests.unit.tokenizer.strings import VARIED_STRINGS, WIKITEXT

BACKENDS = ["tiktoken", "tokenizers"]


@pytest.fixture(scope="module")
def reference(gpt2_files):
    return ReferenceGPT2(*gpt2_files)


@pytest.fixture(scope="module", params=BACKENDS)
def tokenizer(request, gpt2_files):
    if request.param == "tiktoken":
        pytest.importorskip("tiktoken")
    tok = GPT2BPETokenizer(*gpt2_files, backend=request.param)
    assert tok.backend == request.param
    return tok


def test_sizes_and_eod(tokenizer):
    assert tokenizer.vocab_size == 50257
    assert tokenizer.eod == 50256


@pytest.mark.parametrize("text", VARIED_STRINGS, ids=range(len(VARIED_STRINGS)))
def test_ids_equal_reference(tokenizer, reference, text):
    ids = tokenizer.tokenize(text)
    assert ids == reference.encode(text)
    assert tokenizer.tokenize_to_numpy(text).tolist() == ids
    assert tokenizer.detokenize(ids) == text


def test_known_ids(tokenizer):
    # Published GPT-2 ids.
    assert tokenizer.tokenize("Hello world") == [15496, 995]
    assert tokenizer.tokenize(" Hello world") == [18435, 995]


def test_endoftext_literal_is_text(tokenizer):
    ids = tokenizer.tokenize("a <|endoftext|> b")
    assert tokenizer.eod not in ids
    assert ids == [64, 1279, 91, 437, 1659, 5239, 91, 29, 275]
    assert tokenizer.detokenize([tokenizer.eod]) == EOD_TOKEN


def test_batch_matches_single(tokenizer):
    assert tokenizer.tokenize_batch(VARIED_STRINGS) == [
        tokenizer.tokenize(t) for t in VARIED_STRINGS
    ]


def test_lone_surrogate_is_an_error(tokenizer):
    with pytest.raises(LoneSurrogateError):
        tokenizer.tokenize("a\ud800b")
    with pytest.raises(LoneSurrogateError):
        tokenizer.tokenize_to_numpy("\udfff")
    with pytest.raises(TypeError):
        tokenizer.tokenize(["not", "text"])


def test_all_of_wikitext2_valid_matches_reference(gpt2_files, reference):
    if not os.path.isfile(WIKITEXT):
        pytest.skip(missing(WIKITEXT_VALID))
    pytest.importorskip("tiktoken")
    with open(WIKITEXT, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fast = GPT2BPETokenizer(*gpt2_files, backend="tiktoken").tokenize_batch(lines)
    hf = GPT2BPETokenizer(*gpt2_files, backend="tokenizers").tokenize_batch(lines)
    assert sum(map(len, fast)) > 200_000
    assert fast == hf
    assert fast == [reference.encode(line) for line in lines]


def test_auto_prefers_tiktoken_and_falls_back(gpt2_files, monkeypatch):
    pytest.importorskip("tiktoken")
    assert GPT2BPETokenizer(*gpt2_files).backend == "tiktoken"
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    tok = GPT2BPETokenizer(*gpt2_files)
    assert tok.backend == "tokenizers"
    assert tok.tokenize("Hello world") == [15496, 995]


def _write_toy_files(tmp_path, merges, merge_ids):
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    for (left, right), token_id in zip(merges, merge_ids):
        vocab[left + right] = token_id
    vocab[EOD_TOKEN] = 256 + len(merges)
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    return str(vocab_file), str(merge_file)


def test_vocab_not_in_merge_order_uses_tokenizers(tmp_path):
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    files = _write_toy_files(tmp_path, merges, [259, 258, 257, 256])
    tok = GPT2BPETokenizer(*files)
    assert tok.backend == "tokenizers"
    reference = ReferenceGPT2(*files)
    for text in ["hello", "hell hello ohello", "shellhell"]:
        assert tok.tokenize(text) == reference.encode(text)
    with pytest.raises(TokenizerFileError, match="merge order"):
        GPT2BPETokenizer(*files, backend="tiktoken")


def test_toy_vocab_in_merge_order_uses_tiktoken(tmp_path):
    pytest.importorskip("tiktoken")
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    files = _write_toy_files(tmp_path, merges, [256, 257, 258, 259])
    tok = GPT2BPETokenizer(*files)
    assert tok.backend == "tiktoken"
    assert tok.tokenize("hello hello") == [259, 32, 259]  # toy ids: byte b is id b
    assert tok.vocab_size == 261 and tok.eod == 260


def test_missing_files_name_the_flag(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    with pytest.raises(TokenizerConfigError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "nope.json"), merges)
    with pytest.raises(TokenizerConfigError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab, None)


def test_bad_files_name_the_file(tmp_path):
    bad_vocab = tmp_path / "v.json"
    bad_vocab.write_text("{not json", encoding="utf-8")
    merges = tmp_path / "m.txt"
    merges.write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="v.json"):
        GPT2BPETokenizer(str(bad_vocab), str(merges))
    bad_vocab.write_text(json.dumps({"a": 0}), encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="<\\|endoftext\\|>"):
        GPT2BPETokenizer(str(bad_vocab), str(merges))
    bad_vocab.write_text(json.dumps({"a": 0, EOD_TOKEN: 1}), encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="m.txt.*line 2"):
        GPT2BPETokenizer(str(bad_vocab), str(merges))


def test_numpy_dtype(tokenizer):
    arr = tokenizer.tokenize_to_numpy("Hello world")
    assert arr.dtype == np.uint32
    assert arr.tolist() == [15496, 995]


# Issue 13, case 8: a damaged merges file is named, with its line, not left to tokenizers.


def _cut_merges(gpt2_files, tmp_path, cut):
    """GPT-2's merges.txt cut by ``cut(raw) -> bytes``; returns (vocab, cut file)."""
    vocab, merges = gpt2_files
    raw = open(merges, "rb").read()
    path = tmp_path / "merges.txt"
    path.write_bytes(cut(raw))
    return vocab, str(path)


@pytest.mark.parametrize("cut,words", [
    # Inside a word of a merge: "Ġha v" instead of "Ġha ve" makes 'Ġhav', not in the vocab.
    (lambda raw: raw[:raw.index("Ġha ve\n".encode()) + len("Ġha v".encode())],
     ["line 169", "'Ġhav'", "ends mid-line"]),
    # After the first word of a line.
    (lambda raw: raw[:raw.index("Ġha ve\n".encode()) + len("Ġha".encode())],
     ["line 169", "expected two tokens", "ends mid-line"]),
    # Inside a UTF-8 character ("Ġ" is two bytes).
    (lambda raw: raw[:raw.index("Ġha ve\n".encode()) + 1],
     ["line 169", "not UTF-8"]),
    # Not a merges file at all.
    (lambda raw: b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)), ["line 1", "not UTF-8"]),
])
def test_damaged_merges_file_names_file_and_line(gpt2_files, tmp_path, cut, words):
    vocab, merges = _cut_merges(gpt2_files, tmp_path, cut)
    for backend in ("auto", "tokenizers"):
        with pytest.raises(TokenizerFileError) as err:
            GPT2BPETokenizer(vocab, merges, backend=backend)
        assert f"--merge-file {merges!r}" in str(err.value)
        for word in words:
            assert word in str(err.value)


def test_merges_of_another_vocabulary(tmp_path):
    vocab, merges = _write_toy_files(tmp_path, [("h", "e"), ("l", "l")], [256, 257])
    with open(merges, "a", encoding="utf-8") as f:
        f.write("he ll\n")  # complete line, but 'hell' is no token of this vocabulary
    with pytest.raises(TokenizerFileError, match="line 4.*'hell'.*another vocabulary"):
        GPT2BPETokenizer(vocab, merges)

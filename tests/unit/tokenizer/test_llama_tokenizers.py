"""The Llama family's tokenizers, built here from local text (nothing is downloaded): ids equal
the libraries' own and Hugging Face's conversions of the same files, through build_tokenizer,
tools/preprocess_data.py and a training run's flags."""

from __future__ import annotations

import base64
import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import regex

from megatron.tokenizer import TokenizerConfigError, build_tokenizer
from megatron.tokenizer.llama import LLAMA3_PATTERN, LLAMA3_SPECIAL

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
SAMPLES = ["Hello world, this is a test.", "  leading spaces and\ttabs\nnew lines",
           "Numbers 12345 and café, naïve, 東京 and emoji 🙂.", "", "a</s>b<|begin_of_text|>c",
           "The quick brown fox jumps over the lazy dog."]


def _text() -> str:
    import argparse
    import inspect
    import json as json_module

    docs = [inspect.getdoc(m) or "" for m in (argparse, json_module, collections, regex,
                                              inspect, os)]
    return "\n".join(docs) * 2 + "\n" + "\n".join(SAMPLES)


def make_sp_model(folder) -> str:
    """A SentencePiece BPE model trained on local text with Llama 2's settings, in
    ``folder``; returns its tokenizer.model path."""
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text(_text(), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=600,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, minloglevel=2,
        # Llama 2's settings: no normalization, whitespace kept, digits split
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, add_dummy_prefix=True)
    return str(folder / "tokenizer.model")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    pytest.importorskip("sentencepiece")
    return make_sp_model(tmp_path_factory.mktemp("sp"))


def _train_byte_bpe(text: str, merges: int) -> dict[bytes, int]:
    """A tiny byte-level BPE over Llama 3's pre-tokenized words: ranks as tiktoken stores."""
    words = collections.Counter(w.encode() for w in regex.findall(LLAMA3_PATTERN, text))
    ranks = {bytes([i]): i for i in range(256)}
    seqs = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(merges):
        pairs = collections.Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w, seq in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return ranks


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    ranks = _train_byte_bpe(_text(), 200)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return str(path)


def test_llama2_ids_are_sentencepieces_own_after_bos(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    ours = build_tokenizer("Llama2Tokenizer", tokenizer_name_or_path=sp_model)
    plain = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_name_or_path=sp_model)
    assert ours.vocab_size == 600 and ours.eod == 2 and ours.bos == 1
    for text in SAMPLES:
        assert ours.tokenize(text) == [1] + sp.encode(text)
        assert plain.tokenize(text) == sp.encode(text)
        assert ours.detokenize(ours.tokenize(text)) == sp.decode(sp.encode(text))
    assert ours.tokenize_batch(SAMPLES) == [ours.tokenize(t) for t in SAMPLES]
    assert ours.tokenize_to_numpy(SAMPLES[0]).dtype == np.uint32


def test_llama2_ids_equal_hugging_faces_llama_tokenizer(sp_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    import shutil

    shutil.copy(sp_model, tmp_path / "tokenizer.model")  # converted by transformers on load
    hf = transformers.LlamaTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    ours = build_tokenizer("Llama2Tokenizer", tokenizer_name_or_path=sp_model)
    for text in SAMPLES:
        if "</s>" in text or "<|" in text or text[:1].isspace():
            # HF parses special-token text inside documents (we never do), and its conversion
            # merges a leading run of spaces differently from sentencepiece (whose ids are
            # the reference, checked above)
            continue
        assert ours.tokenize(text) == [hf.bos_token_id] + hf(
            text, add_special_tokens=False)["input_ids"], text


def test_llama3_ids_equal_hugging_faces_conversion_of_the_same_file(llama3_model):
    transformers = pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    hf = TikTokenConverter(vocab_file=llama3_model, pattern=LLAMA3_PATTERN,
                           extra_special_tokens=LLAMA3_SPECIAL).converted()
    ours = build_tokenizer("Llama3Tokenizer", tokenizer_name_or_path=llama3_model)
    n = 256 + 200
    assert ours.vocab_size == n + 256 and ours.bos == n and ours.eod == n + 1
    for text in SAMPLES + [_text()[:3000]]:
        ids = ours.tokenize(text)
        assert ids[0] == ours.bos
        if "<|" not in text:
            assert ids[1:] == hf.encode(text, add_special_tokens=False).ids
        assert ours.detokenize(ids) == text
    assert transformers  # the converter is transformers'


def test_llama_tokenizer_files_are_checked(tmp_path, sp_model):
    with pytest.raises(TokenizerConfigError, match="needs --tokenizer-model"):
        build_tokenizer("Llama2Tokenizer")
    with pytest.raises(TokenizerConfigError, match="is not a file"):
        build_tokenizer("Llama3Tokenizer", tokenizer_name_or_path=str(tmp_path))
    bad = tmp_path / "tokenizer.model"
    bad.write_text("QUJD 0\nnot-base64!! 1\n")
    with pytest.raises(TokenizerConfigError, match=r"line 2: expected"):
        build_tokenizer("Llama3Tokenizer", tokenizer_name_or_path=str(bad))
    with pytest.raises(TokenizerConfigError, match="not a SentencePiece model"):
        build_tokenizer("Llama2Tokenizer", tokenizer_name_or_path=str(bad))


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "Llama3Tokenizer"])
def test_preprocess_data_writes_the_tokenizers_ids(tmp_path, kind, sp_model, llama3_model):
    from megatron.data.indexed_dataset import MMapIndexedDataset

    model = sp_model if kind == "Llama2Tokenizer" else llama3_model
    docs = [s for s in SAMPLES if s.strip()]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(src),
         "--output-prefix", str(out), "--tokenizer-type", kind, "--tokenizer-model", model,
         "--append-eod", "--workers", "1"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    tokenizer = build_tokenizer(kind, tokenizer_name_or_path=model)
    data = MMapIndexedDataset(f"{out}_text_document")
    assert [list(map(int, data[i])) for i in range(len(data))] == [
        tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]


def test_a_run_takes_the_llama_tokenizer_flags(sp_model):
    from megatron.assembly.build import build_run_tokenizer
    from megatron.config import parse_args

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                      "--seq-length", "16", "--max-position-embeddings", "16",
                      "--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
                      "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model],
                     world_size=1)
    tokenizer = build_run_tokenizer(cfg)
    assert tokenizer.vocab_size == 600 and tokenizer.tokenize("Hi")[0] == 1

"""megatron/data/checks.py: the data flags checked before training (issue 13, cases 3 and 6)."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.data import checks
from megatron.data.checks import (
    cached_token_range,
    check_token_ids,
    check_training_data,
    scan_token_range,
)
from megatron.data.dataset_utils import DataConfigError
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)

from .corpus import write_corpus


def _data(**fields):
    """The fields of DataConfig that the checks read."""
    base = dict(data_path=None, train_data_path=None, valid_data_path=None,
                test_data_path=None, mock_data=False, split="90,10,0", data_cache_path=None,
                tokenizer_type="GPT2BPETokenizer", vocab_file="vocab.json",
                tokenizer_name_or_path=None, vocab_size=None)
    return SimpleNamespace(**{**base, **fields})


def _uint16_corpus(prefix, ids_per_doc):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for ids in ids_per_doc:
        builder.add_doc(np.asarray(ids), [len(ids)])
    builder.finalize(prefix + ".idx")


def test_scan_finds_the_id_range_in_chunks(tmp_path):
    prefix = str(tmp_path / "d")
    docs = write_corpus(prefix, [50, 7, 300], dtype=np.int32, vocab=5000)
    every = np.concatenate(docs)
    for chunk_bytes in (4, 44, 1 << 20):
        found = scan_token_range(MMapIndexedDataset(prefix), chunk_bytes=chunk_bytes)
        assert (found.min_id, found.max_id, found.tokens) == (every.min(), every.max(), 357)


def test_range_is_scanned_once_per_version_of_the_files(tmp_path, monkeypatch):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    _uint16_corpus(prefix, [[1, 2, 3], [40000, 5]])
    scans = []
    real_scan = checks.scan_token_range
    monkeypatch.setattr(checks, "scan_token_range", lambda ds: scans.append(1) or real_scan(ds))
    for _ in range(3):
        assert cached_token_range(MMapIndexedDataset(prefix), cache).max_id == 40000
    assert len(scans) == 1
    [name] = [n for n in os.listdir(cache) if n.endswith("_token_range.json")]
    cached = json.loads(open(os.path.join(cache, name)).read())
    assert cached["max_id"] == 40000 and cached["bin_bytes"] == 10
    _uint16_corpus(prefix, [[1, 2, 3], [60000, 5]])  # rewritten: size, mtime differ
    os.utime(prefix + ".bin", ns=(1, 1))
    assert cached_token_range(MMapIndexedDataset(prefix), cache).max_id == 60000
    assert len(scans) == 2


def test_id_above_the_vocabulary_names_file_id_size_and_flag(tmp_path):
    prefix = str(tmp_path / "d")
    _uint16_corpus(prefix, [[1, 2, 3], [60000, 5]])
    with pytest.raises(DataConfigError) as err:
        check_token_ids(MMapIndexedDataset(prefix), 50257, "--vocab-file gpt2-vocab.json",
                        str(tmp_path / "cache"))
    text = str(err.value)
    assert prefix + ".bin" in text and "60000" in text and "50257" in text
    assert "--vocab-file gpt2-vocab.json" in text
    check_token_ids(MMapIndexedDataset(prefix), 60001, "x", str(tmp_path / "cache"))


def test_negative_ids_suggest_the_dtype_code(tmp_path):
    prefix = str(tmp_path / "d")
    _uint16_corpus(prefix, [[1, 2, 3], [40000, 5]])
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[17] = 3  # int16: same item size, so only the ids can tell
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(DataConfigError, match="negative token id -25536 as int16.*dtype code"):
        check_token_ids(MMapIndexedDataset(prefix), 50257, "x", str(tmp_path / "cache"))


def test_missing_prefix_names_the_flag_and_each_missing_file(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [5, 5])
    with pytest.raises(DataConfigError) as err:
        check_training_data(_data(data_path=[str(tmp_path / "nope")]), 1000, 4)
    assert "--data-path" in str(err.value)
    assert "nope.idx" in str(err.value) and "nope.bin" in str(err.value)
    os.remove(prefix + ".bin")
    with pytest.raises(DataConfigError) as err:
        check_training_data(_data(data_path=["1", str(tmp_path / "x"), "1", prefix]), 1000, 4)
    assert "x.idx" in str(err.value)  # the first missing one, in the order given
    write_corpus(str(tmp_path / "t"), [5, 5])
    with pytest.raises(DataConfigError, match=r"--valid-data-path: .* has no .*d\.bin$"):
        check_training_data(_data(train_data_path=[str(tmp_path / "t")],
                                  valid_data_path=[prefix]), 1000, 0)


def test_corrupt_dataset_names_the_flag_and_file(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [5, 5], dtype=np.uint16)
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[17] = 1
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(IndexedDatasetError, match=r"^--train-data-path: .*d\.idx"):
        check_training_data(_data(train_data_path=[prefix]), 1000, 4)


def test_dataset_without_documents(tmp_path):
    prefix = str(tmp_path / "empty")
    write_corpus(prefix, [])
    with pytest.raises(DataConfigError, match=r"--data-path: .*empty\.idx holds no documents"):
        check_training_data(_data(data_path=[prefix]), 1000, 4)


@pytest.mark.parametrize("split,words", [("0,100,0", "gives training no weight"),
                                         ("0,1", "gives training no weight"),
                                         ("1,1000000,0", "leaves 0 of the 10 documents")])
def test_empty_training_split_names_split(tmp_path, split, words):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [5] * 10)
    with pytest.raises(DataConfigError, match=f"--split {split} {words}"):
        check_training_data(_data(data_path=[prefix], split=split), 1000, 4)
    check_training_data(_data(data_path=[prefix], split=split), 1000, 0)  # eval only: fine


def test_training_split_of_empty_documents(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [0, 0, 0, 9])
    with pytest.raises(DataConfigError, match=r"\(0 tokens\) for training"):
        check_training_data(_data(data_path=[prefix], split="3,1,0"), 1000, 4)


@pytest.mark.parametrize("documents", [50, 201])
def test_a_split_without_training_samples_is_refused_on_any_dataset(tmp_path, documents):
    """--split 0,50,50: Megatron's rounding gives training no document of 50 but one of 201
    (which then trained epoch after epoch); both are refused, by the same one line."""
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [40] * documents)
    with pytest.raises(DataConfigError) as err:
        check_training_data(_data(data_path=[prefix], split="0,50,50"), 1000, 8, seq_length=32)
    assert str(err.value) == (
        f"--split 0,50,50 gives training no weight (Megatron's rounding leaves it "
        f"{documents // 200} of the {documents} documents of {prefix}), but 8 training "
        "samples are asked for (--train-iters/--train-samples); give the training share a "
        "weight")


def test_a_training_share_without_one_sample_is_refused(tmp_path):
    """A weighted share must hold one sample's --seq-length + 1 tokens; one token fewer
    would repeat its documents inside every sample."""
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [33] + [1] * 99)
    check_training_data(_data(data_path=[prefix], split="1,99,0"), 1000, 8, seq_length=32)
    with pytest.raises(DataConfigError) as err:
        check_training_data(_data(data_path=[prefix], split="1,99,0"), 1000, 8, seq_length=33)
    assert str(err.value) == (
        f"--split 1,99,0 leaves 1 of the 100 documents of {prefix} (33 tokens) for training, "
        "fewer than one training sample needs (34 at --seq-length 33), but 8 training samples "
        "are asked for (--train-iters/--train-samples); give the training share more weight")
    check_training_data(_data(train_data_path=[prefix]), 1000, 8, seq_length=131)
    with pytest.raises(DataConfigError, match=r"^--train-data-path: .*d holds 132 tokens, "
                       r"fewer than one training sample needs \(133 .*; give it more data$"):
        check_training_data(_data(train_data_path=[prefix]), 1000, 8, seq_length=132)


def test_no_training_source(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [5, 5])
    with pytest.raises(DataConfigError, match="no training data.*--train-data-path"):
        check_training_data(_data(valid_data_path=[prefix]), 1000, 4)


def test_good_data_and_mock_data_pass(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [5] * 10, vocab=1000)
    cache = str(tmp_path / "cache")
    check_training_data(_data(data_path=["0.5", prefix, "0.5", prefix], data_cache_path=cache),
                        1000, 4)
    assert any(n.endswith("_token_range.json") for n in os.listdir(cache))
    check_training_data(_data(data_path=["nope"], mock_data=True), 1000, 4)


def test_unwritable_data_cache_path_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [5] * 10)
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # root may write anywhere else; nobody makes a folder in a file
    with pytest.raises(DataConfigError, match="--data-cache-path .*a-file/cache.* not a writable"):
        check_training_data(_data(data_path=[prefix], data_cache_path=str(blocker / "cache")),
                            1000, 4)
    assert not (tmp_path / "user-cache").exists()


def test_a_blend_whose_validation_share_misses_one_dataset_is_refused(tmp_path):
    """Each dataset of a blend gives validation samples by its weight: one without
    validation documents is refused before training (it stopped every rank after the model
    was built); without evaluation, or with no dataset in the share, the blend is fine."""
    big, small = str(tmp_path / "big"), str(tmp_path / "small")
    write_corpus(big, [40] * 100)
    write_corpus(small, [40] * 5)
    data = _data(data_path=["0.5", big, "0.5", small], split="98,2,0")
    with pytest.raises(DataConfigError) as err:
        check_training_data(data, 1000, 8, seq_length=32, eval_samples=(16, 0))
    assert str(err.value) == (
        f"--split 98,2,0 leaves no validation documents of {small} (5 documents in all), but "
        "the blend --data-path draws 16 validation samples from each of its datasets by "
        "weight (--eval-iters); give the validation share more weight, or evaluate with "
        "--eval-iters 0")
    check_training_data(data, 1000, 8, seq_length=32, eval_samples=(0, 0))
    check_training_data(_data(data_path=["0.5", big, "0.5", small], split="98,0,2"), 1000, 8,
                        seq_length=32, eval_samples=(16, 0))  # no dataset has validation

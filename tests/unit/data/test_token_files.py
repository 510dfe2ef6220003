"""Flat token files (nanoGPT .bin, llm.c shards, .npy shards) as GPT datasets (issue 15)."""

import os

import numpy as np
import pytest

from megatron.data import token_files
from megatron.data.dataset_utils import DataConfigError
from megatron.data.gpt_dataset import build_train_valid_test_datasets

SEQ = 16


def _llmc_shard(path, tokens, version=1):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (token_files.LLMC_MAGIC, version, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2" if version == 1 else "<u4").tobytes())


def _build(path, impl, tmp_path, split="80,10,10", samples=(20, 4, 4), **kw):
    return build_train_valid_test_datasets(path, impl, split, list(samples), SEQ, 1234, True,
                                           data_cache_path=str(tmp_path / "cache"), **kw)


def test_samples_are_contiguous_windows_of_one_flat_file(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "all.bin")
    train, valid, test = _build(str(tmp_path / "all.bin"), "flat", tmp_path)
    starts = []
    for i in range(len(train)):
        text = train[i]["text"]
        assert text.shape == (SEQ + 1,)
        assert np.array_equal(np.diff(text), np.ones(SEQ))  # one window of the stream
        starts.append(int(text[0]))
    assert sorted(starts) == list(range(0, 800 - SEQ, SEQ))  # every window once per epoch
    assert starts != sorted(starts)  # seeded shuffled order
    assert int(valid[0]["text"].min()) >= 800 and int(test[0]["text"].min()) >= 900
    again = _build(str(tmp_path / "all.bin"), "flat", tmp_path)[0]
    assert [int(again[i]["text"][0]) for i in range(len(again))] == starts


def test_llmc_header_and_npy_shards_read_the_same_tokens(tmp_path):
    tokens = np.random.RandomState(0).randint(0, 50000, size=3000)
    (tmp_path / "llmc").mkdir()
    (tmp_path / "npy").mkdir()
    for k, part in enumerate(np.array_split(tokens, 3)):
        _llmc_shard(tmp_path / "llmc" / f"fineweb_train_{k:06d}.bin", part, version=1 + k % 2)
        np.save(tmp_path / "npy" / f"shard_{k:06d}.npy", part.astype(np.uint16))
    flat = _build(str(tmp_path / "llmc"), "flat", tmp_path)
    npy = _build(str(tmp_path / "npy" / "shard_*.npy"), "infer", tmp_path)
    assert token_files.infer_token_impl(str(tmp_path / "npy" / "shard_*.npy")) == "npy"
    for a, b in zip(flat, npy):
        assert len(a) == len(b)
        for i in range(len(a)):
            assert np.array_equal(a[i]["text"], b[i]["text"])


def test_pieces_cut_long_files_and_pickle(tmp_path, monkeypatch):
    import pickle

    monkeypatch.setattr(token_files, "PIECE_TOKENS", 100)
    np.arange(450, dtype=np.uint16).tofile(tmp_path / "x.bin")
    f = token_files.open_token_file(str(tmp_path / "x.bin"), "flat")
    spans = token_files.TokenSpans([(f, 20, 400)], in_memory=True)
    assert spans.sizes.tolist() == [100, 100, 100, 100]
    assert spans.get(2, 5, 3).tolist() == [225, 226, 227]
    assert pickle.loads(pickle.dumps(spans)).get(3).tolist() == list(range(320, 420))


@pytest.mark.parametrize("write,words", [
    (lambda p: open(p, "wb").write(b"\x01\x02\x03"), "not a whole number of uint16"),
    (lambda p: _llmc_shard(p, np.arange(10), version=7), "header version 7"),
    (lambda p: open(p, "wb").write(np.array([token_files.LLMC_MAGIC, 1, 99] + [0] * 253,
                                            dtype="<i4").tobytes()), "truncated"),
])
def test_bad_flat_files_are_named(tmp_path, write, words):
    path = str(tmp_path / "bad.bin")
    write(path)
    with pytest.raises(DataConfigError, match=words) as err:
        _build(path, "flat", tmp_path)
    assert path in str(err.value)


def test_bad_npy_and_empty_folder_are_named(tmp_path):
    np.save(tmp_path / "two_d.npy", np.zeros((2, 3), dtype=np.uint16))
    with pytest.raises(DataConfigError, match="1-D integer"):
        _build(str(tmp_path / "two_d.npy"), "npy", tmp_path)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(DataConfigError, match="holds no npy token files"):
        _build(str(tmp_path / "empty"), "npy", tmp_path)


def test_training_data_check_names_a_bad_token_file_before_training(tmp_path):
    from types import SimpleNamespace

    from megatron.data.checks import check_training_data

    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "val.bin")
    data = SimpleNamespace(data_path=[str(tmp_path)], data_impl="infer", split="98,2,0",
                           mock_data=False, tokenizer_type="NullTokenizer", vocab_size=64)
    check_training_data(data, 64, train_samples=8)  # a nanoGPT folder passes
    open(tmp_path / "val.bin", "ab").write(b"\x00")
    with pytest.raises(DataConfigError, match="--data-path: .*val.bin: 101 bytes"):
        check_training_data(data, 64, train_samples=8)


def test_weighted_blend_of_token_files(tmp_path):
    np.arange(0, 3000, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.arange(30000, 31000, dtype=np.uint16).tofile(tmp_path / "b.npy.bin")
    blend = [0.75, str(tmp_path / "a.bin"), 0.25, str(tmp_path / "b.npy.bin")]
    train = _build(blend, "flat", tmp_path, split="100,0,0", samples=(200, 0, 0))[0]
    first = [int(train[i]["text"][0]) for i in range(200)]
    from_b = sum(x >= 30000 for x in first)
    assert 40 <= from_b <= 60  # a quarter of the samples, as the weights ask
    with pytest.raises(DataConfigError, match="splits itself"):
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
        os.makedirs(tmp_path / "folder")
        for name in ("train.bin", "val.bin"):
            os.replace(tmp_path / name, tmp_path / "folder" / name)
        build_train_valid_test_datasets(None, "flat", "1,0,0", [4, 0, 0], SEQ, 1, True,
                                        train_data_prefix=str(tmp_path / "folder"),
                                        data_cache_path=str(tmp_path / "cache"))


def test_the_split_of_a_token_folder_is_said_once(tmp_path, caplog):
    """The start-up checks read the files before the builder does; only the builder says
    how they split (issue 22: the "no test split" line printed twice)."""
    import logging
    from types import SimpleNamespace

    from megatron.data.checks import check_training_data

    np.arange(400, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    data = SimpleNamespace(data_path=[str(tmp_path)], data_impl="flat", split="98,2,0",
                           mock_data=False, tokenizer_type="NullTokenizer", vocab_size=512)
    with caplog.at_level(logging.INFO, logger="megatron"):
        check_training_data(data, 512, train_samples=8, seq_length=SEQ)
        _build(str(tmp_path), "flat", tmp_path, samples=(8, 4, 0))
    said = [r.getMessage() for r in caplog.records if "(no test split)" in r.getMessage()]
    assert said == [f" > {tmp_path}: train files {[str(tmp_path / 'train.bin')]}, validation "
                    f"files {[str(tmp_path / 'val.bin')]} (no test split)"]

import importlib.util
import os

import numpy as np
import pytest

from megatron.data import gpt_dataset
from megatron.data.gpt_dataset import build_train_valid_test_datasets

from .corpus import random_lengths, write_corpus

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "build_index_cache.py")


def _tool():
    spec = importlib.util.spec_from_file_location("build_index_cache", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prebuilt_cache_is_loaded_by_training(tmp_path, monkeypatch, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(a, random_lengths(80, 1, 50, seed=1), seed=1)
    write_corpus(b, random_lengths(40, 1, 50, seed=2), seed=2)
    cache = str(tmp_path / "cache")
    rc = _tool().main(["--data-path", "0.35", a, "0.65", b, "--split", "949,50,1",
                       "--seq-length", "16", "--seed", "1234", "--train-iters", "50",
                       "--global-batch-size", "8", "--eval-iters", "2", "--eval-interval", "25",
                       "--data-cache-path", cache])
    assert rc == 0
    out = capsys.readouterr().out
    assert "train: asked 400 samples" in out and "valid: asked 48 samples" in out

    def must_not_build(*args, **kwargs):
        raise AssertionError("the tool should have built this cache")

    monkeypatch.setattr(gpt_dataset, "build_index_arrays", must_not_build)
    train, valid, _ = build_train_valid_test_datasets(
        ["0.35", a, "0.65", b], "mmap", "949,50,1", [400, 48, 16], 16, 1234, True,
        data_cache_path=cache)
    assert len(train) >= 400 and len(valid) >= 48
    assert np.asarray(train.dataset_index).shape == (len(train),)


def test_tool_reports_bad_flags(tmp_path, capsys):
    assert _tool().main(["--data-path", "1", str(tmp_path / "x"), "--seq-length", "8",
                         "--train-samples", "10"]) == 1
    assert "--global-batch-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _tool().main(["--data-path", "x"])  # --seq-length is required


# Issue 13, case 8: a damaged cache is a miss, an unwritable --data-cache-path an error.

_FLAGS = ["--split", "90,10,0", "--seq-length", "16", "--train-iters", "20",
          "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "10"]


def _damage(path, how):
    raw = open(path, "rb").read()
    open(path, "wb").write({"truncated": raw[: len(raw) // 2], "header": raw[:60],
                            "empty": b"", "garbage": b"\x93NUMPY" + b"\xff" * 200}[how])


@pytest.mark.parametrize("kind", ["sample_idx", "doc_idx", "shuffle_idx"])
@pytest.mark.parametrize("how", ["truncated", "header", "empty", "garbage"])
def test_damaged_cached_npy_is_rebuilt_by_the_tool(tmp_path, capsys, kind, how):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(60, 5, 50, seed=3), seed=3)
    argv = ["--data-path", prefix, "--data-cache-path", cache, *_FLAGS]
    assert _tool().main(argv) == 0
    files = sorted(n for n in os.listdir(cache) if n.endswith(f"_{kind}.npy"))
    intact = {n: open(os.path.join(cache, n), "rb").read() for n in files}
    for name in files:
        _damage(os.path.join(cache, name), how)
    capsys.readouterr()
    assert _tool().main(argv) == 0, capsys.readouterr().err
    for name in files:
        assert open(os.path.join(cache, name), "rb").read() == intact[name]


def test_damaged_cache_is_rebuilt_by_the_training_loader(tmp_path):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(60, 5, 50, seed=3), seed=3)
    args = ([prefix], "mmap", "90,10,0", [80, 12, 0], 16, 1234, True)
    first = build_train_valid_test_datasets(*args, data_cache_path=cache)[0]
    expected = [first[i]["text"] for i in range(len(first))]
    _damage(os.path.join(cache, f"{first.desc_hash}_sample_idx.npy"), "truncated")
    again = build_train_valid_test_datasets(*args, data_cache_path=cache)[0]
    assert [again[i]["text"].tolist() for i in range(len(again))] == \
        [e.tolist() for e in expected]


def test_unwritable_data_cache_path_is_an_error_not_a_fallback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    prefix = str(tmp_path / "d")
    write_corpus(prefix, random_lengths(60, 5, 50, seed=3), seed=3)
    (tmp_path / "a-file").write_text("")  # no folder can be made inside a file, even by root
    cache = str(tmp_path / "a-file" / "cache")
    assert _tool().main(["--data-path", prefix, "--data-cache-path", cache, *_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --data-cache-path") and cache in err
    assert not (tmp_path / "user-cache").exists()
    assert not (tmp_path / "index-cache").exists()

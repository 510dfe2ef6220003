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

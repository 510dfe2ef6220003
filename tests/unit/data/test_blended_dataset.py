import os

import numpy as np
import pytest

from megatron.data.blended_dataset import BlendedDataset, build_blending_index
from megatron.data.dataset_utils import DataConfigError, parse_data_path
from megatron.data.gpt_dataset import build_train_valid_test_datasets

from .corpus import random_lengths, write_corpus


@pytest.fixture
def corpora(tmp_path):
    os.makedirs(tmp_path / "data")
    a, b = str(tmp_path / "data" / "wiki"), str(tmp_path / "data" / "owt")
    write_corpus(a, random_lengths(200, 1, 60, seed=1), seed=1)
    write_corpus(b, random_lengths(120, 1, 60, seed=2), seed=2)
    return a, b


def _fractions(blend, k):
    idx = np.array([int(blend[i]["dataset_idx"]) for i in range(len(blend))])
    return np.bincount(idx, minlength=k) / len(blend)


def test_gpt3_recipe_proportions_within_one_percent(corpora, tmp_path):
    a, b = corpora
    train, valid, _ = build_train_valid_test_datasets(
        ["0.35", a, "0.65", b], "mmap", "949,50,1", [3000, 200, 0], 16, 1234, True,
        data_cache_path=str(tmp_path / "cache"))
    assert len(train) >= 3000
    np.testing.assert_allclose(_fractions(train, 2), [0.35, 0.65], atol=0.01)
    np.testing.assert_allclose(_fractions(valid, 2), [0.35, 0.65], atol=0.01)
    sample = train[5]
    assert sample["text"].shape == (17,) and sample["text"].dtype == np.int64
    # The same data path given as one string parses the same way.
    assert parse_data_path(f"0.35 {a} 0.65 {b}") == ([a, b], [0.35, 0.65])


def test_three_way_blend_index_proportions():
    weights = [0.2, 0.3, 0.5]
    index, sample = build_blending_index(weights, 4000)
    np.testing.assert_allclose(np.bincount(index) / 4000, weights, atol=0.01)
    for d in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(sample[index == d], np.arange((index == d).sum()))


@pytest.mark.parametrize("weights", [("0.999", "0.001"), ("0.001", "0.999")])
def test_extreme_weights_and_tiny_corpus_do_not_raise(corpora, tmp_path, weights):
    a, _ = corpora
    tiny = str(tmp_path / "data" / "tiny")
    write_corpus(tiny, [3, 2, 4], seed=3)  # 9 tokens, one document per split
    splits = build_train_valid_test_datasets(
        [weights[0], a, weights[1], tiny], "mmap", "1,1,1", [2000, 300, 50], 8, 7, True,
        data_cache_path=str(tmp_path / "cache"))
    for blend in splits:
        for i in range(len(blend)):  # every sample is reachable
            assert blend[i]["text"].shape == (9,)


def test_zero_or_negative_weight_is_an_error_naming_it(corpora, tmp_path):
    a, b = corpora
    for w in ("0", "-0.5"):
        with pytest.raises(DataConfigError, match=f"weight {w} of '{b}'"):
            build_train_valid_test_datasets(["1", a, w, b], "mmap", "1", [10, 0, 0], 8, 1, True,
                                            data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataConfigError, match="not a number"):
        build_train_valid_test_datasets(["x", a, "1", b], "mmap", "1", [10, 0, 0], 8, 1, True)
    with pytest.raises(DataConfigError, match="pairs"):
        build_train_valid_test_datasets(["1", a, "1"], "mmap", "1", [10, 0, 0], 8, 1, True)


def test_dataset_without_documents_in_a_split_is_named(corpora, tmp_path):
    a, _ = corpora
    small = str(tmp_path / "data" / "small")
    write_corpus(small, [30, 30, 30], seed=4)  # 949,50,1 leaves it no valid documents
    with pytest.raises(DataConfigError, match=f"{small} has no documents in the valid split"):
        build_train_valid_test_datasets(["0.5", a, "0.5", small], "mmap", "949,50,1",
                                        [100, 10, 0], 8, 1, True,
                                        data_cache_path=str(tmp_path / "cache"))


class _Fixed:
    def __init__(self, n, tag):
        self.n, self.tag, self.data_prefix, self.name = n, tag, f"/data/{tag}", "train"

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"text": np.array([self.tag, i])}


def test_blended_dataset_checks_each_dataset_is_long_enough():
    blend = BlendedDataset([_Fixed(30, 0), _Fixed(80, 1)], [0.3, 0.7], 100)
    assert len(blend) == 100 and {int(blend[i]["text"][0]) for i in range(100)} == {0, 1}
    with pytest.raises(IndexError):
        blend[100]
    with pytest.raises(DataConfigError, match="/data/0 \\(train\\), which has only 20"):
        BlendedDataset([_Fixed(20, 0), _Fixed(80, 1)], [0.3, 0.7], 100)


def test_data_path_parsing_keeps_paths_with_spaces():
    assert parse_data_path("/data/my corpus/text_document") == (
        ["/data/my corpus/text_document"], None)
    assert parse_data_path(["/d/a"]) == (["/d/a"], None)
    assert parse_data_path(None) is None

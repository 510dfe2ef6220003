import logging
import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from megatron.data import gpt_dataset
from megatron.data.dataset_utils import (
    DataConfigError,
    FileLock,
    description_hash,
    get_train_valid_test_split_,
    train_valid_test_num_samples,
)
from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset

from .corpus import random_lengths, write_corpus
from .test_helpers import reference_sample_idx


def megatron_deepspeed_reference(documents, sizes, num_samples, seq_length, seed):
    """Megatron-DeepSpeed's _build_index_mappings re-derived step by step, loops and all."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    separate, before_last = False, 0
    if epochs > 1:
        before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = (num_samples - before_last) < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed=seed)

    def shuffled_docs(n_epochs):
        grid = np.mgrid[0:n_epochs, 0:len(documents)][1]
        grid[:] = documents
        flat = grid.reshape(-1).astype(np.int32)
        rng.shuffle(flat)
        return flat

    doc_idx = (np.concatenate((shuffled_docs(epochs - 1), shuffled_docs(1))) if separate
               else shuffled_docs(epochs))
    sample_idx = reference_sample_idx(sizes, doc_idx, seq_length, epochs,
                                      tokens_per_epoch).astype(np.int32)
    n = len(sample_idx) - 1
    first = before_last if separate else n
    head = np.arange(first, dtype=np.uint32)
    rng.shuffle(head)
    if first < n:
        tail = np.arange(first, n, dtype=np.uint32)
        rng.shuffle(tail)
        head = np.concatenate((head, tail))
    return doc_idx, sample_idx, head, separate, epochs


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "data" / "corpus")
    os.makedirs(os.path.dirname(prefix))
    write_corpus(prefix, random_lengths(60, 0, 30, seed=5), positional=True)
    return prefix


@pytest.mark.parametrize("seed,num_samples,want_separate,want_epochs", [
    (1234, 20, False, 1),
    (7, 20, False, 1),
    (1234, 170, False, 2),   # the last epoch is nearly full: shuffled with the others
    (1234, 105, True, 2),    # the last epoch is barely used: shuffled separately
    (99, 400, True, 5),
])
def test_index_arrays_equal_megatron_deepspeed(corpus, tmp_path, seed, num_samples,
                                               want_separate, want_epochs):
    indexed = MMapIndexedDataset(corpus)
    documents = np.arange(3, 57, dtype=np.int32)
    seq = 8
    ref_doc, ref_sample, ref_shuffle, separate, epochs = megatron_deepspeed_reference(
        documents, indexed.sizes, num_samples, seq, seed)
    assert (separate, epochs) == (want_separate, want_epochs)
    ds = GPTDataset("train", corpus, documents, indexed, "949,50,1", num_samples, seq, seed,
                    data_cache_path=str(tmp_path / "cache"))
    assert ds.doc_idx.dtype == np.int32 and ds.sample_idx.dtype == np.int32
    assert ds.shuffle_idx.dtype == np.uint32
    np.testing.assert_array_equal(ds.doc_idx, ref_doc)
    np.testing.assert_array_equal(ds.sample_idx, ref_sample)
    np.testing.assert_array_equal(ds.shuffle_idx, ref_shuffle)
    assert len(ds) >= num_samples


def test_samples_are_consecutive_windows_of_the_shuffled_stream(corpus, tmp_path):
    indexed = MMapIndexedDataset(corpus)
    documents = np.arange(len(indexed.sizes), dtype=np.int32)
    seq = 6
    ds = GPTDataset("train", corpus, documents, indexed, "1", 10, seq, 3,
                    data_cache_path=str(tmp_path / "cache"))
    stream = np.concatenate([indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)
    unshuffle = np.argsort(ds.shuffle_idx)
    inputs = []
    for k in range(len(ds)):
        text = ds[int(unshuffle[k])]["text"]
        assert text.dtype == np.int64 and text.shape == (seq + 1,)
        np.testing.assert_array_equal(text, stream[k * seq:k * seq + seq + 1])
        inputs.append(text[:-1])
    # Tokens are their own .bin positions: every token of the epoch is an input exactly once,
    # except the remainder after the last full sample.
    inputs = np.sort(np.concatenate(inputs))
    remainder = len(stream) - len(ds) * seq
    assert 1 <= remainder <= seq
    np.testing.assert_array_equal(inputs, np.sort(stream[:len(stream) - remainder]))


@pytest.mark.parametrize("split,size,want", [
    ("949,50,1", 1000, [0, 949, 999, 1000]),
    ("98,2,0", 50, [0, 49, 50, 50]),
    ("1", 7, [0, 7, 7, 7]),
    ("90/10", 10, [0, 9, 10, 10]),
    ("969, 30, 1", 3, [0, 3, 3, 3]),
])
def test_split_boundaries(split, size, want):
    assert get_train_valid_test_split_(split, size) == want


def test_split_and_num_samples_errors():
    with pytest.raises(DataConfigError, match="--split"):
        get_train_valid_test_split_("a,b", 10)
    with pytest.raises(DataConfigError, match="--split"):
        get_train_valid_test_split_("0,0,0", 10)
    assert train_valid_test_num_samples(8, 2, 50, train_iters=100) == [800, 48, 16]


def test_build_single_prefix_splits(corpus, tmp_path):
    train, valid, test = build_train_valid_test_datasets(
        [corpus], "mmap", "80,20,0", [50, 10, 5], 8, 1234, True,
        data_cache_path=str(tmp_path / "cache"))
    assert test is None
    assert len(train) >= 50 and len(valid) >= 10
    assert train.sample_idx.shape[1] == 2
    np.testing.assert_array_equal(np.unique(train.doc_idx), np.arange(48))
    np.testing.assert_array_equal(np.unique(valid.doc_idx), np.arange(48, 60))


def test_separate_train_valid_test_paths(corpus, tmp_path):
    other = str(tmp_path / "data" / "other")
    write_corpus(other, random_lengths(10, 5, 20, seed=9))
    train, valid, test = build_train_valid_test_datasets(
        None, "mmap", "949,50,1", [30, 8, 0], 8, 1, True, train_data_prefix=[corpus],
        valid_data_prefix=[other], data_cache_path=str(tmp_path / "cache"))
    assert test is None and len(train) >= 30 and len(valid) >= 8
    np.testing.assert_array_equal(np.unique(valid.doc_idx), np.arange(10))
    with pytest.raises(DataConfigError, match="--data-path"):
        build_train_valid_test_datasets(None, "mmap", "1", [1, 1, 1], 8, 1, True)


def test_cache_is_reused_and_named_like_megatron_deepspeed(corpus, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    indexed = MMapIndexedDataset(corpus)
    docs = np.arange(60, dtype=np.int32)
    first = GPTDataset("train", corpus, docs, indexed, "1", 100, 8, 5, data_cache_path=cache)
    desc = (f"GPT Dataset\n\nData prefix {corpus}\nDataset name train\nNumber of samples 100\n"
            "Number of epochs 1\nSequence length 8\nRandom seed 5\nSplit 1\n")
    assert first.desc == desc
    key = description_hash(desc)
    names = set(os.listdir(cache))
    for suffix in ("_doc_idx.npy", "_sample_idx.npy", "_shuffle_idx.npy", ".dsc", ".json"):
        assert key + suffix in names
    assert open(os.path.join(cache, key + ".dsc")).read() == desc
    mtimes = {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in names}

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cache should have been loaded")

    monkeypatch.setattr(gpt_dataset, "build_index_arrays", must_not_build)
    second = GPTDataset("train", corpus, docs, indexed, "1", 100, 8, 5, data_cache_path=cache)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in names} == mtimes
    # Without --data-cache-path the index-cache folder beside the data is searched first.
    monkeypatch.undo()
    GPTDataset("train", corpus, docs, indexed, "1", 100, 8, 5)
    assert key + "_doc_idx.npy" in os.listdir(os.path.join(os.path.dirname(corpus),
                                                           "index-cache"))


def test_stale_cache_for_changed_data_is_rebuilt(tmp_path):
    prefix = str(tmp_path / "d")
    write_corpus(prefix, [10] * 20)
    cache = str(tmp_path / "cache")
    docs = np.arange(20, dtype=np.int32)
    GPTDataset("train", prefix, docs, MMapIndexedDataset(prefix), "1", 10, 4, 1,
               data_cache_path=cache)
    write_corpus(prefix, [30] * 20)  # same prefix and flags, different data
    indexed = MMapIndexedDataset(prefix)
    ds = GPTDataset("train", prefix, docs, indexed, "1", 10, 4, 1, data_cache_path=cache)
    assert len(ds) == (600 - 1) // 4
    fresh = gpt_dataset.build_index_arrays(docs, indexed.sizes, 10, 4, 1)
    np.testing.assert_array_equal(ds.sample_idx, fresh["sample_idx"])


def test_read_only_data_dir_falls_back_to_user_cache(corpus, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data_dir = os.path.dirname(corpus)
    if os.geteuid() == 0:
        # root ignores permission bits: a plain file where the folder should be blocks it too.
        open(os.path.join(data_dir, "index-cache"), "w").close()
    else:
        os.chmod(data_dir, 0o555)
    try:
        indexed = MMapIndexedDataset(corpus)
        docs = np.arange(60, dtype=np.int32)
        with caplog.at_level(logging.WARNING):
            ds = GPTDataset("train", corpus, docs, indexed, "1", 20, 8, 1)
        assert "not writable" in caplog.text
        user_dir = tmp_path / "xdg" / "megatron-gpt" / "index-cache"
        assert any(n.endswith("_sample_idx.npy") for n in os.listdir(user_dir))
        again = GPTDataset("train", corpus, docs, indexed, "1", 20, 8, 1)
        np.testing.assert_array_equal(again.shuffle_idx, ds.shuffle_idx)
    finally:
        os.chmod(data_dir, 0o755)


def test_waits_for_the_lock_of_another_builder(corpus, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    indexed = MMapIndexedDataset(corpus)
    docs = np.arange(60, dtype=np.int32)
    key = description_hash(gpt_dataset.index_description("train", corpus, 20, 1, 8, 1, "1"))
    result = {}

    def build():
        result["ds"] = GPTDataset("train", corpus, docs, indexed, "1", 20, 8, 1,
                                  data_cache_path=str(cache))

    with FileLock(str(cache / f"{key}.lock")):
        worker = threading.Thread(target=build)
        worker.start()
        time.sleep(0.6)
        assert worker.is_alive()
        assert not any(n.endswith(".npy") for n in os.listdir(cache))
    worker.join(timeout=30)
    assert len(result["ds"]) >= 20
    with FileLock(str(cache / "other.lock")):
        with pytest.raises(TimeoutError, match="other.lock"):
            with FileLock(str(cache / "other.lock"), timeout_s=0.3):
                pass


def _build_in_process(corpus, cache, log, queue):
    real = gpt_dataset.build_index_arrays

    def slow_counted(*args, **kwargs):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.3)
        return real(*args, **kwargs)

    gpt_dataset.build_index_arrays = slow_counted
    indexed = MMapIndexedDataset(corpus)
    ds = GPTDataset("train", corpus, np.arange(60, dtype=np.int32), indexed, "1", 50, 8, 2,
                    data_cache_path=cache)
    queue.put(np.asarray(ds.shuffle_idx).tolist())


def test_concurrent_processes_build_once(corpus, tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    log = str(tmp_path / "builds.log")
    procs = [ctx.Process(target=_build_in_process,
                         args=(corpus, str(tmp_path / "cache"), log, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    orders = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert orders[0] == orders[1] == orders[2]
    assert open(log).read().count("built") == 1


def test_empty_split_and_tiny_split_errors(tmp_path):
    prefix = str(tmp_path / "t")
    write_corpus(prefix, [0, 1, 0, 0])
    with pytest.raises(DataConfigError, match="holds 1 tokens"):
        build_train_valid_test_datasets([prefix], "mmap", "1", [5, 0, 0], 4, 1, True,
                                        data_cache_path=str(tmp_path / "c"))


def test_numpy_fallback_gives_the_same_index(corpus, monkeypatch):
    from megatron.data import helpers

    indexed = MMapIndexedDataset(corpus)
    docs = np.arange(60, dtype=np.int32)
    with_default = gpt_dataset.build_index_arrays(docs, indexed.sizes, 300, 8, 11)
    monkeypatch.setattr(helpers, "_cpp", None)
    assert not helpers.cpp_available()
    fallback = gpt_dataset.build_index_arrays(docs, indexed.sizes, 300, 8, 11)
    for name, array in with_default.items():
        assert array.dtype == fallback[name].dtype
        np.testing.assert_array_equal(array, fallback[name])


def test_pickles_without_index_arrays(corpus, tmp_path):
    import pickle

    indexed = MMapIndexedDataset(corpus)
    ds = GPTDataset("train", corpus, np.arange(60, dtype=np.int32), indexed, "1", 30, 8, 1,
                    data_cache_path=str(tmp_path / "cache"))
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # paths and parameters, not the arrays
    again = pickle.loads(blob)
    for i in (0, 7, len(ds) - 1):
        np.testing.assert_array_equal(again[i]["text"], ds[i]["text"])


def _our_append_eod_corpus(prefix, n=60, eod=1000, seed=3):
    """Documents of random ids below ``eod`` with the EOD counted (our preprocess_data.py)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for length in random_lengths(n, 1, 30, seed=seed):
        builder.add_doc(np.append(rng.integers(0, eod, size=length), eod), [length + 1])
    builder.finalize(prefix + ".idx")


def test_megatron_deepspeed_append_eod_samples_equal_what_its_index_gives(tmp_path):
    """Issue 22 item 1: index arrays and every sample of Megatron-DeepSpeed's --append-eod
    pair are what its uncounted sizes give, read at its pointers."""
    from .corpus import uncount_eods

    prefix = str(tmp_path / "mds")
    _our_append_eod_corpus(prefix)
    uncount_eods(prefix)
    raw = np.fromfile(prefix + ".bin", dtype=np.uint16)
    sizes = np.fromfile(prefix + ".idx", dtype="<i4", count=60, offset=34)  # as written
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))  # Megatron-DeepSpeed's pointers

    def mds_read(i):
        return raw[starts[i]:starts[i] + sizes[i]].astype(np.int64)

    train, valid, _ = build_train_valid_test_datasets(
        [prefix], "mmap", "80,20,0", [150, 20, 0], 8, 1234, True,
        data_cache_path=str(tmp_path / "cache"))
    for ds, documents in ((train, np.arange(48)), (valid, np.arange(48, 60))):
        ref_doc, ref_sample, ref_shuffle, _, _ = megatron_deepspeed_reference(
            documents.astype(np.int32), sizes, ds.num_samples, 8, 1234)
        np.testing.assert_array_equal(ds.doc_idx, ref_doc)
        np.testing.assert_array_equal(ds.sample_idx, ref_sample)
        np.testing.assert_array_equal(ds.shuffle_idx, ref_shuffle)
        stream = np.concatenate([mds_read(d) for d in ref_doc])
        for j in range(len(ds)):
            k = int(ref_shuffle[j])
            np.testing.assert_array_equal(ds[j]["text"], stream[k * 8:k * 8 + 9])


def test_cache_of_the_old_index_is_rebuilt_after_fix_eod_index(tmp_path, caplog):
    """The cache is named from the flags only: after --fix-eod-index rewrites the sizes the
    old sample index does not fit, even where its shapes do, and is rebuilt."""
    from megatron.data.eod_index import fix_uncounted_eod_index

    from .corpus import uncount_eods

    prefix, ours, cache = str(tmp_path / "mds"), str(tmp_path / "ours"), str(tmp_path / "c")
    _our_append_eod_corpus(prefix)
    _our_append_eod_corpus(ours)
    uncount_eods(prefix)
    docs = np.arange(60, dtype=np.int32)
    GPTDataset("train", prefix, docs, MMapIndexedDataset(prefix), "1", 30, 8, 5,
               data_cache_path=cache)
    fix_uncounted_eod_index(prefix)
    with caplog.at_level(logging.WARNING):
        fixed = GPTDataset("train", prefix, docs, MMapIndexedDataset(prefix), "1", 30, 8, 5,
                           data_cache_path=cache)
    assert "does not fit this data" in caplog.text
    want = GPTDataset("train", ours, docs, MMapIndexedDataset(ours), "1", 30, 8, 5,
                      data_cache_path=str(tmp_path / "c2"))
    assert len(fixed) == len(want)
    for j in range(len(want)):
        np.testing.assert_array_equal(fixed[j]["text"], want[j]["text"])


def test_cache_of_other_sizes_with_the_same_shapes_is_rebuilt(tmp_path, caplog):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    docs = np.arange(20, dtype=np.int32)
    write_corpus(prefix, [10] * 20)
    GPTDataset("train", prefix, docs, MMapIndexedDataset(prefix), "1", 10, 4, 1,
               data_cache_path=cache)
    write_corpus(prefix, [9, 11] * 10)  # the same tokens in all: the same array shapes
    indexed = MMapIndexedDataset(prefix)
    with caplog.at_level(logging.WARNING):
        ds = GPTDataset("train", prefix, docs, indexed, "1", 10, 4, 1, data_cache_path=cache)
    assert "sample_idx ends at token" in caplog.text
    fresh = gpt_dataset.build_index_arrays(docs, indexed.sizes, 10, 4, 1)
    np.testing.assert_array_equal(ds.sample_idx, fresh["sample_idx"])


def test_a_split_asked_for_no_samples_builds_no_dataset(corpus, tmp_path):
    """Issue 22 item 2: --eval-iters 0 (no validation or test samples) builds no dataset,
    not an empty one, for a blend, one prefix, per-split paths and token files alike."""
    other = str(tmp_path / "data" / "other")
    write_corpus(other, random_lengths(40, 5, 20, seed=9))
    flat = str(tmp_path / "tokens.bin")
    np.arange(3000, dtype=np.uint16).tofile(flat)
    forms = {
        "one prefix": dict(data_prefix=[corpus]),
        "blend": dict(data_prefix=["0.5", corpus, "0.5", other]),
        "per-split paths": dict(data_prefix=None, train_data_prefix=[corpus],
                                valid_data_prefix=["0.3", other, "0.7", corpus],
                                test_data_prefix=[other]),
        "token files": dict(data_prefix=[flat], data_impl="flat"),
    }
    for form, kwargs in forms.items():
        kwargs = {"data_impl": "mmap", **kwargs}
        cache = str(tmp_path / "cache" / form)
        built = build_train_valid_test_datasets(
            splits_string="80,10,10", train_valid_test_num_samples=[40, 0, 0], seq_length=8,
            seed=1, skip_warmup=True, data_cache_path=cache, **kwargs)
        assert built[1:] == (None, None), form
        assert len(built[0]) >= 40, form
        built = build_train_valid_test_datasets(
            splits_string="80,10,10", train_valid_test_num_samples=[40, 8, 0], seq_length=8,
            seed=1, skip_warmup=True, data_cache_path=cache, **kwargs)
        assert len(built[1]) >= 8 and built[2] is None, form


def test_a_split_without_documents_is_no_dataset_for_a_blend_as_for_one_prefix(corpus,
                                                                               tmp_path,
                                                                               caplog):
    blend = ["0.5", corpus, "0.5", corpus]
    for data_prefix, named in (([corpus], corpus), (blend, f"{corpus}, {corpus}")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            built = build_train_valid_test_datasets(
                data_prefix, "mmap", "100,0,0", [40, 8, 0], 8, 1, True,
                data_cache_path=str(tmp_path / "cache"))
        assert built[1:] == (None, None)
        assert caplog.messages == [f"{named}: the valid split of --split 100,0,0 has no "
                                   "documents; no valid dataset (8 samples were asked for)"]

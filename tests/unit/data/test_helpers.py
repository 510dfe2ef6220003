import numpy as np
import pytest

from megatron.data import helpers

needs_cpp = pytest.mark.skipif(not helpers.cpp_available(),
                               reason="megatron.data.helpers_cpp is not built")


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's walk, written out plainly (drop last partial sample, one extra token)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    row, offset = 0, 0
    for k in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[row]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                row, offset = row + 1, 0
        out[k] = row, offset
    return out


def reference_blend(weights, size):
    taken = [0] * len(weights)
    index, sample = [], []
    for i in range(size):
        errors = [w * max(i, 1) - t for w, t in zip(weights, taken)]
        best = int(np.argmax(errors))  # first maximum, as the strict '>' of the C++ loop
        index.append(best)
        sample.append(taken[best])
        taken[best] += 1
    return np.array(index), np.array(sample)


def _random_case(rng):
    n = int(rng.integers(1, 30))
    sizes = rng.integers(0, 25, size=n).astype(np.int32)
    sizes[0] = max(sizes[0], 3)
    epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(np.arange(n, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    return sizes, doc_idx, int(rng.integers(1, 16)), epochs, int(sizes.sum())


def test_numpy_sample_idx_matches_reference_walk():
    rng = np.random.default_rng(1)
    for _ in range(200):
        sizes, doc_idx, seq, epochs, tokens = _random_case(rng)
        got = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tokens, use_cpp=False)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, reference_sample_idx(sizes, doc_idx, seq, epochs,
                                                                tokens))


@needs_cpp
def test_cpp_and_numpy_sample_idx_agree():
    rng = np.random.default_rng(2)
    for _ in range(300):
        sizes, doc_idx, seq, epochs, tokens = _random_case(rng)
        drop, extra = bool(rng.integers(0, 2)), int(rng.integers(0, 2))
        args = (sizes, doc_idx, seq, epochs, tokens, drop, extra)
        a = helpers.build_sample_idx(*args, use_cpp=True)
        b = helpers.build_sample_idx(*args, use_cpp=False)
        assert a.dtype == b.dtype == np.int32
        np.testing.assert_array_equal(a, b)
        c = helpers.build_sample_idx(sizes, doc_idx.astype(np.int64), seq, epochs, tokens,
                                     drop, extra, dtype=np.int64, use_cpp=True)
        assert c.dtype == np.int64
        np.testing.assert_array_equal(c, a)


@pytest.mark.parametrize("use_cpp", [pytest.param(True, marks=needs_cpp), False])
def test_sample_idx_covers_each_token_once_except_remainder(use_cpp):
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 30, size=40).astype(np.int32)
    doc_idx = rng.permutation(40).astype(np.int32)
    stream = np.concatenate([np.arange(sizes[:d].sum(), sizes[:d + 1].sum()) for d in doc_idx])
    tokens, seq = int(sizes.sum()), 7
    idx = helpers.build_sample_idx(sizes, doc_idx, seq, 1, tokens, use_cpp=use_cpp)
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx])])
    position = starts[idx[:, 0]] + idx[:, 1]  # global start of each sample in the stream
    np.testing.assert_array_equal(position, np.arange(len(idx)) * seq)
    inputs = np.concatenate([stream[p:p + seq] for p in position[:-1]])
    remainder = tokens - (len(idx) - 1) * seq
    assert 1 <= remainder <= seq  # the last label token plus fewer than seq_length unused
    np.testing.assert_array_equal(np.sort(inputs), np.sort(stream[:tokens - remainder]))


def test_sample_idx_rejects_bad_doc_idx():
    with pytest.raises((IndexError, ValueError)):
        helpers.build_sample_idx(np.array([3, 4], np.int32), np.array([0, 2], np.int32), 2, 1, 7)


@pytest.mark.parametrize("use_cpp", [pytest.param(True, marks=needs_cpp), False])
def test_blending_matches_reference(use_cpp):
    rng = np.random.default_rng(4)
    for _ in range(30):
        k = int(rng.integers(1, 6))
        w = rng.random(k)
        w /= w.sum()
        size = int(rng.integers(0, 500))
        index = np.zeros(size, np.uint8)
        sample = np.zeros(size, np.int64)
        helpers.build_blending_indices(index, sample, w, k, size, use_cpp=use_cpp)
        want_index, want_sample = reference_blend(list(w), size)
        np.testing.assert_array_equal(index, want_index.astype(np.uint8))
        np.testing.assert_array_equal(sample, want_sample)


@needs_cpp
def test_cpp_and_python_blending_agree_on_ties_and_int16():
    for w in ([0.5, 0.5], [1 / 3] * 3, [0.999, 0.001], [0.35, 0.65], [0.1] * 10):
        for dtype in (np.uint8, np.int16):
            out = []
            for use_cpp in (True, False):
                index, sample = np.zeros(2000, dtype), np.zeros(2000, np.int64)
                helpers.build_blending_indices(index, sample, w, len(w), 2000, use_cpp=use_cpp)
                out.append((index, sample))
            np.testing.assert_array_equal(out[0][0], out[1][0])
            np.testing.assert_array_equal(out[0][1], out[1][1])


@needs_cpp
def test_cpp_blending_refuses_wrong_output_dtype():
    with pytest.raises(ValueError, match="uint8 or int16"):
        helpers.build_blending_indices(np.zeros(4, np.int64), np.zeros(4, np.int64),
                                       np.array([1.0]), 1, 4, use_cpp=True)

"""Build the GPT dataset index caches (doc/sample/shuffle idx .npy) ahead of a training job,
and the token id range of each dataset that training checks against the vocabulary.

Run it once on each node's file system (or once on a shared one) with the same data flags as
the job; training then only loads the files.  A cached file that cannot be read (truncated,
not .npy) is rebuilt.  Example:

    python tools/build_index_cache.py --data-path 0.35 wiki_text_document 0.65 owt_text_document \\
        --split 949,50,1 --seq-length 2048 --seed 1234 \\
        --train-iters 500000 --global-batch-size 512 --eval-iters 10 --eval-interval 1000 \\
        --data-cache-path /scratch/index-cache

Needs no torch and no GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.checks import cached_token_range, data_sources  # noqa: E402
from megatron.data.dataset_utils import (  # noqa: E402
    DEFAULT_SPLIT,
    DataConfigError,
    train_valid_test_num_samples,
)
from megatron.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from megatron.data.indexed_dataset import MMapIndexedDataset  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="one prefix, or weight/prefix pairs: 0.35 wiki 0.65 owt")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--split", default=DEFAULT_SPLIT,
                   help=f"train,valid,test weights (default: {DEFAULT_SPLIT})")
    g.add_argument("--data-impl", default="mmap",
                   choices=["mmap", "infer", "lazy", "cached", "flat", "npy"])
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lock-timeout", type=float, default=7200.0,
                   help="seconds to wait for another process building the same cache")
    s = p.add_argument_group("sample counts (either explicit samples or iterations)")
    s.add_argument("--train-samples", type=int, default=None)
    s.add_argument("--valid-samples", type=int, default=None)
    s.add_argument("--test-samples", type=int, default=None)
    s.add_argument("--train-iters", type=int, default=None)
    s.add_argument("--global-batch-size", type=int, default=None)
    s.add_argument("--eval-iters", type=int, default=100)
    s.add_argument("--eval-interval", type=int, default=1000)
    return p


def sample_counts(args: argparse.Namespace) -> list[int]:
    """[train, valid, test] samples from explicit counts or from iterations x batch size."""
    explicit = (args.valid_samples, args.test_samples)
    if args.train_samples is not None and all(v is not None for v in explicit):
        return [args.train_samples, args.valid_samples, args.test_samples]
    if args.global_batch_size is None:
        raise DataConfigError("--global-batch-size is needed unless --train-samples, "
                              "--valid-samples and --test-samples are all given")
    counts = train_valid_test_num_samples(args.global_batch_size, args.eval_iters,
                                          args.eval_interval, train_iters=args.train_iters,
                                          train_samples=args.train_samples)
    for i, v in enumerate(explicit, start=1):
        if v is not None:
            counts[i] = v
    return counts


def scan_token_ranges(args: argparse.Namespace) -> None:
    """Cache the token id range of every dataset too, which training checks against the
    vocabulary (one full read of each .bin, done here rather than in the job)."""
    for _, prefixes in data_sources(args):
        for prefix in prefixes:
            dataset = MMapIndexedDataset(prefix)
            found = cached_token_range(dataset, args.data_cache_path, args.lock_timeout)
            dataset.close()
            print(f"token ids of {prefix}: {found.min_id}..{found.max_id} "
                  f"({found.tokens} tokens)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        counts = sample_counts(args)
        start = time.time()
        datasets = build_train_valid_test_datasets(
            args.data_path, args.data_impl, args.split, counts, args.seq_length, args.seed,
            skip_warmup=True, train_data_prefix=args.train_data_path,
            valid_data_prefix=args.valid_data_path, test_data_prefix=args.test_data_path,
            data_cache_path=args.data_cache_path, lock_timeout_s=args.lock_timeout)
    except (DataConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, n, ds in zip(("train", "valid", "test"), counts, datasets):
        got = "none" if ds is None else f"{type(ds).__name__} of {len(ds)} samples"
        print(f"{name}: asked {n} samples -> {got}")
    try:
        scan_token_ranges(args)
    except (DataConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"index caches ready in {time.time() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

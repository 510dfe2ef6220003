"""nanoGPT / FineWeb token files train like .bin/.idx datasets (issue 15, item 3).

A nanoGPT-style folder (``train.bin`` / ``val.bin``, raw uint16) trains with ``--data-impl
flat``, and 16 iterations straight equal 8, a checkpoint, and 8 more, bit for bit (losses,
grad norms, learning rates, validation losses and the order of the samples). FineWeb-style
``.npy`` shards, found by ``--data-impl infer``, train too, read from RAM with ``--in-memory``
the same as memory-mapped; two data-parallel gloo ranks on the token file give the losses of
one process within 1e-5.
"""

import os
import re

import numpy as np
import pytest

import pretrain_gpt
from megatron.core import parallel_state
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import (
    RecordingIterator,
    base_argv,
    build_small_corpus,
    captured_stdout,
)

ITERS = 16
FLAGS = {"--train-iters": ITERS, "--hidden-dropout": 0.1, "--eval-interval": 4,
         "--eval-iters": 1, "--split": None}


def _write_token_files(corpus: dict, folder: str) -> dict:
    tokens = np.concatenate(list(MMapIndexedDataset(corpus["prefix"])[:])).astype(np.uint16)
    cut = int(0.9 * len(tokens))
    nanogpt = os.path.join(folder, "shakespeare_char")
    os.makedirs(nanogpt)
    tokens[:cut].tofile(os.path.join(nanogpt, "train.bin"))  # nanoGPT's prepare.py
    tokens[cut:].tofile(os.path.join(nanogpt, "val.bin"))
    fineweb = os.path.join(folder, "edu_fineweb10B")
    os.makedirs(fineweb)
    np.save(os.path.join(fineweb, "edufineweb_val_000000.npy"), tokens[cut:])
    for k, part in enumerate(np.array_split(tokens[:cut], 3), start=1):
        np.save(os.path.join(fineweb, f"edufineweb_train_{k:06d}.npy"), part)
    return {"nanogpt": nanogpt, "fineweb": fineweb}


def _run(argv: list[str]) -> dict:
    samples: list = []

    def forward_step(ctx, data_iterator, model, stage):
        return pretrain_gpt.forward_step(ctx, RecordingIterator(data_iterator, samples),
                                         model, stage)

    parallel_state.destroy_model_parallel()
    with captured_stdout() as out:
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, forward_step, argv=argv)
    log = out.getvalue()
    return dict(steps=[(h["iteration"], h["losses"]["lm loss"], h["grad_norm"])
                       for h in state.history],
                consumed=state.consumed_train_samples, samples=samples, log=log,
                validation=re.findall(r"validation loss at iteration (\d+) \| lm loss value: "
                                      r"(\S+)", log))


def _all_runs(rank, world_size, corpus, folder):
    paths = _write_token_files(corpus, folder)
    cache = f"{folder}/cache"
    flat = base_argv(corpus, cache, **FLAGS, **{"--data-path": paths["nanogpt"],
                                                 "--data-impl": "flat"})
    save = ["--save", f"{folder}/ckpt", "--save-interval", "1000"]
    results = {"straight": _run(flat),
               "first": _run(flat + save + ["--exit-interval", str(ITERS // 2)]),
               "second": _run(flat + save + ["--load", f"{folder}/ckpt"])}
    npy = base_argv(corpus, cache, **{**FLAGS, "--train-iters": 6},
                    **{"--data-path": paths["fineweb"], "--data-impl": "infer"})
    results["npy"] = _run(npy)
    results["npy_in_memory"] = _run(npy + ["--in-memory"])
    results["flat6"] = _flat_run(rank, world_size, corpus, folder)
    return results


def _flat_run(rank, world_size, corpus, folder):
    """6 iterations on the nanoGPT folder (written by the one-process run)."""
    argv = base_argv(corpus, f"{folder}/cache-{world_size}", **{
        **FLAGS, "--train-iters": 6, "--hidden-dropout": 0.0,
        "--data-path": f"{folder}/shakespeare_char", "--data-impl": "flat"})
    return _run(argv)["steps"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("token_files"))
    corpus = build_small_corpus(str(tmp_path_factory.mktemp("corpus")))
    return corpus, folder


@pytest.fixture(scope="module")
def runs(setup):
    return run_distributed(_all_runs, 1, *setup)[0]


def test_nanogpt_train_bin_resumes_bit_for_bit(runs):
    straight, first, second = runs["straight"], runs["first"], runs["second"]
    assert "train files" in straight["log"] and "val.bin" in straight["log"]
    assert [s[0] for s in first["steps"]] == list(range(1, ITERS // 2 + 1))
    assert [s[0] for s in second["steps"]] == list(range(ITERS // 2 + 1, ITERS + 1))
    assert first["steps"] + second["steps"] == straight["steps"]  # exact
    assert first["samples"] + second["samples"] == straight["samples"]  # data order
    assert first["validation"] + second["validation"] == straight["validation"]
    assert len(straight["validation"]) == ITERS // 4
    assert second["consumed"] == straight["consumed"] == ITERS * 4
    losses = [loss for _, loss, _ in straight["steps"]]
    assert losses[-1] < losses[0]  # it learns from the token file


def test_npy_shards_train_and_in_memory_reads_the_same(runs):
    npy, in_memory = runs["npy"], runs["npy_in_memory"]
    assert len(npy["steps"]) == 6 and all(np.isfinite(s[1]) for s in npy["steps"])
    assert "edufineweb_val_000000.npy" in npy["log"]
    assert in_memory["steps"] == npy["steps"] and in_memory["samples"] == npy["samples"]


def test_two_data_parallel_ranks_equal_one_process(setup, runs):
    one = runs["flat6"]
    two = run_distributed(_flat_run, 2, *setup)
    assert two[0] == two[1]  # both ranks report the same reduced values
    assert [s[0] for s in two[0]] == [s[0] for s in one] == list(range(1, 7))
    for (_, loss2, norm2), (_, loss1, norm1) in zip(two[0], one):
        assert loss2 == pytest.approx(loss1, rel=1e-5)
        assert norm2 == pytest.approx(norm1, rel=1e-5)

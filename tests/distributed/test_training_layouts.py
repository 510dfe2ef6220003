"""Every (tensor, data) layout trains the same model: losses, grad norms and params norms
(--log-params-norm) through the real pretrain() entry equal the one-process run within 1e-5
relative (fp32)."""

import math

import pytest

import pretrain_gpt
from tests.dist_utils import run_distributed
from tests.distributed import training_utils

ITERS = 5


def base_argv(corpus, cache_dir, **overrides):
    return training_utils.base_argv(corpus, cache_dir, **{
        "--global-batch-size": 8, "--train-iters": ITERS, "--lr": 1e-3, "--min-lr": 1e-4,
        "--lr-warmup-iters": 1, "--log-params-norm": True, **overrides})


def _train(rank, world_size, argv):
    state = pretrain_gpt.main(argv)
    return [(h["losses"]["lm loss"], h["grad_norm"], h["params_norm"]) for h in state.history]


def train(world_size, argv):
    histories = run_distributed(_train, world_size, argv)
    for other in histories[1:]:  # every rank reports the same reduced loss and norm
        assert other == histories[0]
    return histories[0]


def assert_same_run(got, expected, rel=1e-5):
    assert len(got) == len(expected) == ITERS
    for i, (step, ref_step) in enumerate(zip(got, expected)):
        for name, value, ref in zip(("loss", "grad norm", "params norm"), step, ref_step):
            assert math.isclose(value, ref, rel_tol=rel), (i, name, value, ref)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    run = train(1, base_argv(corpus, cache))
    losses = [loss for loss, *_ in run]
    assert losses[-1] < losses[0], "the reference run does not learn"
    params_norms = [norm for *_, norm in run]
    assert params_norms[0] > 1.0 and params_norms[-1] != params_norms[0]
    return cache, run


@pytest.mark.parametrize("world,flags", [
    (2, {"--tensor-model-parallel-size": 2}),
    (2, {}),  # dp = 2
    (4, {"--tensor-model-parallel-size": 2}),  # tp = 2, dp = 2
    (2, {"--use-distributed-optimizer": True}),
    (2, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}),
    (2, {"--overlap-grad-reduce": True, "--micro-batch-size": 1}),
], ids=["tp2", "dp2", "tp2dp2", "dp2-distopt", "tp2-seqpar", "dp2-overlap-accum"])
def test_layout_matches_single_process(corpus, reference, world, flags):
    cache, expected = reference
    assert_same_run(train(world, base_argv(corpus, cache, **flags)), expected)


def test_gradient_accumulation_equals_one_big_micro_batch(corpus, reference):
    cache, expected = reference  # global batch 8 = 4 micro-batches of 2
    assert_same_run(train(1, base_argv(corpus, cache, **{"--micro-batch-size": 8})), expected)

"""Every (tensor, data) layout trains the same model: losses, grad norms and params norms
(--log-params-norm) through the real pretrain() entry equal the one-process run within 1e-5
relative (fp32), for GPT and for the Llama family's options (RMSNorm, SwiGLU, grouped-query
attention, RoPE, untied, no biases) on the layouts that cut them."""


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
    return training_utils.run_norms(pretrain_gpt.main(argv).history)


def train(world_size, argv):
    histories = run_distributed(_train, world_size, argv)
    for other in histories[1:]:  # every rank reports the same reduced loss and norm
        assert other == histories[0]
    return histories[0]


def assert_same_run(got, expected, rel=1e-5):
    training_utils.assert_same_run(got, expected, ITERS, rel)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """``reference(family)``: (cache folder, the family's flags, its one-process run), run
    once per family."""
    runs = {}

    def get(name: str):
        if name not in runs:
            family = training_utils.FAMILIES[name]
            cache = str(tmp_path_factory.mktemp("cache"))
            run = train(1, base_argv(corpus, cache, **family))
            losses = [loss for loss, *_ in run]
            assert losses[-1] < losses[0], "the reference run does not learn"
            params_norms = [norm for *_, norm in run]
            assert params_norms[0] > 1.0 and params_norms[-1] != params_norms[0]
            runs[name] = cache, family, run
        return runs[name]
    return get


LAYOUTS = {
    "tp2": (2, {"--tensor-model-parallel-size": 2}),
    "dp2": (2, {}),
    "tp2dp2": (4, {"--tensor-model-parallel-size": 2}),
    "dp2-distopt": (2, {"--use-distributed-optimizer": True}),
    "tp2-seqpar": (2, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}),
    "dp2-overlap-accum": (2, {"--overlap-grad-reduce": True, "--micro-batch-size": 1}),
    # Recomputation replays RMSNorm, SwiGLU and grouped attention (one process).
    "full-recompute": (1, {"--recompute-granularity": "full", "--recompute-method": "uniform"}),
    "selective-recompute": (1, {"--recompute-granularity": "selective"}),
}
# The Llama family runs the layouts that cut its parameters differently: heads and query
# groups and SwiGLU's [gate; up] over tensor ranks, RMSNorm under sequence parallelism, the
# distributed optimizer's shards of them.
CASES = [("gpt", name) for name in LAYOUTS if "recompute" not in name] + [
    ("llama", name) for name in ("tp2", "tp2-seqpar", "dp2-distopt", "full-recompute",
                                 "selective-recompute")]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{n}" if f != "gpt" else n
                                                      for f, n in CASES])
def test_layout_matches_single_process(corpus, reference, family, layout):
    cache, flags, expected = reference(family)
    world, layout_flags = LAYOUTS[layout]
    assert_same_run(train(world, base_argv(corpus, cache, **flags, **layout_flags)), expected)


@pytest.mark.parametrize("family", list(training_utils.FAMILIES))
def test_gradient_accumulation_equals_one_big_micro_batch(corpus, reference, family):
    cache, flags, expected = reference(family)  # global batch 8 = 4 micro-batches of 2
    assert_same_run(train(1, base_argv(corpus, cache, **flags, **{"--micro-batch-size": 8})),
                    expected)

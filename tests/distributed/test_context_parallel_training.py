"""Context parallelism and DeepSpeed-Ulysses through the real pretrain() entry: losses, grad
norms and params norms over 10 iterations equal the one-process run within 1e-5 relative
(fp32), alone and combined with tensor, pipeline and data parallelism with the distributed
optimizer, for GPT and for the Llama family's options (RoPE, grouped-query attention)."""

import math

import pytest

import pretrain_gpt
from tests.dist_utils import run_distributed
from tests.distributed import training_utils

ITERS = 10


def base_argv(corpus, cache_dir, **overrides):
    return training_utils.base_argv(corpus, cache_dir, **{
        "--global-batch-size": 4, "--train-iters": ITERS, "--lr": 1e-3, "--min-lr": 1e-4,
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
    """``reference(family)``: (cache folder, the family's flags, its one-process run)."""
    runs = {}

    def get(name: str):
        if name not in runs:
            family = training_utils.FAMILIES[name]
            cache = str(tmp_path_factory.mktemp("cache"))
            run = train(1, base_argv(corpus, cache, **family))
            assert run[-1][0] < run[0][0], "the reference run does not learn"
            runs[name] = cache, family, run
        return runs[name]
    return get


def _cp(n, kind="p2p"):
    if kind == "ulysses":
        return {"--ds-sequence-parallel-size": n}
    return {"--context-parallel-size": n, "--cp-comm-type": kind}


TP2 = {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}
PP2 = {"--pipeline-model-parallel-size": 2}
DP2 = {"--use-distributed-optimizer": True}
LAYOUTS = {
    "cp2-p2p": (2, _cp(2)),
    "cp4-p2p": (4, _cp(4)),
    "cp2-a2a": (2, _cp(2, "a2a")),
    "cp4-a2a": (4, _cp(4, "a2a")),
    "cp2-allgather": (2, _cp(2, "allgather")),
    "ulysses2": (2, _cp(2, "ulysses")),
    "ulysses4": (4, _cp(4, "ulysses")),
    "cp2-p2p-tp2-seqpar": (4, {**_cp(2), **TP2}),
    "cp2-p2p-pp2": (4, {**_cp(2), **PP2}),
    "cp2-p2p-dp2-distopt": (4, {**_cp(2), **DP2}),
    "cp2-a2a-tp2": (4, {**_cp(2, "a2a"), "--tensor-model-parallel-size": 2}),
    "ulysses2-pp2": (4, {**_cp(2, "ulysses"), **PP2}),
    "ulysses2-dp2-distopt": (4, {**_cp(2, "ulysses"), **DP2}),
}
CASES = [("gpt", name) for name in LAYOUTS] + [
    ("llama", name) for name in ("cp2-p2p-tp2-seqpar", "cp4-a2a", "ulysses2-dp2-distopt")]


@pytest.mark.parametrize("family,layout", CASES,
                         ids=[f"{f}-{n}" if f != "gpt" else n for f, n in CASES])
def test_context_parallel_layout_matches_single_process(corpus, reference, family, layout):
    cache, flags, expected = reference(family)
    world, layout_flags = LAYOUTS[layout]
    assert_same_run(train(world, base_argv(corpus, cache, **flags, **layout_flags)), expected)

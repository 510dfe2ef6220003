"""Context parallelism and DeepSpeed-Ulysses through the real pretrain() entry: losses, grad
norms and params norms over 10 iterations equal the one-process run within 1e-5 relative
(fp32), alone and combined with tensor, pipeline and data parallelism with the distributed
optimizer, for GPT and for the Llama family's options (RoPE, grouped-query attention)."""

import math

import pytest

import pretrain_gpt
from megatron.core import parallel_state
from tests.dist_utils import run_distributed
from tests.distributed import training_utils

ITERS = 10


def base_argv(corpus, cache_dir, **overrides):
    return training_utils.base_argv(corpus, cache_dir, **{
        "--global-batch-size": 4, "--train-iters": ITERS, "--lr": 1e-3, "--min-lr": 1e-4,
        "--lr-warmup-iters": 1, "--log-params-norm": True, **overrides})


def _train(rank, world_size, argv):
    state = pretrain_gpt.main(argv)
    split = (parallel_state.get_context_parallel_world_size(),
             parallel_state.get_data_parallel_world_size())
    return split, training_utils.run_norms(state.history)


def train(world_size, argv, context=1, data=None):
    """The run's history; asserts the sequence was split over ``context`` ranks and the
    samples over ``data`` (default: what the rest of the world leaves)."""
    per_rank = run_distributed(_train, world_size, argv)
    for split, history in per_rank:
        assert split == (context, data or world_size // context)
        assert history == per_rank[0][1]  # every rank reports the same reduced loss and norm
    return per_rank[0][1]


def assert_same_run(got, expected, rel=1e-5):
    training_utils.assert_same_run(got, expected, ITERS, rel)


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
LAYOUTS = {  # name: (world size, context ranks, data ranks, flags)
    "cp2-p2p": (2, 2, 1, _cp(2)),
    "cp4-p2p": (4, 4, 1, _cp(4)),
    "cp2-a2a": (2, 2, 1, _cp(2, "a2a")),
    "cp4-a2a": (4, 4, 1, _cp(4, "a2a")),
    "cp2-allgather": (2, 2, 1, _cp(2, "allgather")),
    "ulysses2": (2, 2, 1, _cp(2, "ulysses")),
    "ulysses4": (4, 4, 1, _cp(4, "ulysses")),
    "cp2-p2p-tp2-seqpar": (4, 2, 1, {**_cp(2), **TP2}),
    "cp2-p2p-pp2": (4, 2, 1, {**_cp(2), **PP2}),
    "cp2-p2p-dp2-distopt": (4, 2, 2, {**_cp(2), **DP2}),
    "cp2-a2a-tp2": (4, 2, 1, {**_cp(2, "a2a"), "--tensor-model-parallel-size": 2}),
    "ulysses2-pp2": (4, 2, 1, {**_cp(2, "ulysses"), **PP2}),
    "ulysses2-dp2-distopt": (4, 2, 2, {**_cp(2, "ulysses"), **DP2}),
    # Recompute runs the ring (and its sends) again in the backward pass.
    "cp2-p2p-full-recompute": (2, 2, 1, {**_cp(2), "--recompute-granularity": "full",
                                         "--recompute-method": "uniform"}),
    "cp2-a2a-selective-recompute": (2, 2, 1, {**_cp(2, "a2a"),
                                              "--recompute-granularity": "selective"}),
}
CASES = [("gpt", name) for name in LAYOUTS] + [
    ("llama", name) for name in ("cp2-p2p-tp2-seqpar", "cp4-a2a", "ulysses2-dp2-distopt")]


@pytest.mark.parametrize("family,layout", CASES,
                         ids=[f"{f}-{n}" if f != "gpt" else n for f, n in CASES])
def test_context_parallel_layout_matches_single_process(corpus, reference, family, layout):
    cache, flags, expected = reference(family)
    world, context, data, layout_flags = LAYOUTS[layout]
    assert_same_run(train(world, base_argv(corpus, cache, **flags, **layout_flags), context,
                          data), expected)


def test_eod_mask_loss_and_reset_position_ids_match_single_process(corpus, tmp_path):
    """The loss mask and the reset positions are cut with the tokens: learned positions of
    each rank's chunks, and a loss totalled over the context group."""
    flags = {"--eod-mask-loss": True, "--reset-position-ids": True}
    cache = str(tmp_path / "cache")
    expected = train(1, base_argv(corpus, cache, **flags))
    assert_same_run(train(2, base_argv(corpus, cache, **flags, **_cp(2)), 2), expected)


def test_resume_is_bit_for_bit_and_loads_without_context_parallelism(corpus, reference,
                                                                      tmp_path):
    """Saved at context-parallel size 2 with the distributed optimizer (its state sharded
    over data x context ranks): resumed at 2 the steps are the straight run's bit for bit;
    resumed by one process they continue it within 1e-5."""
    cache, _, _ = reference("gpt")
    flags = {**_cp(2), **DP2}
    save = str(tmp_path / "ckpt")
    straight = train(2, base_argv(corpus, cache, **flags), 2)
    first = train(2, base_argv(corpus, cache, **flags, **{
        "--save": save, "--save-interval": 5, "--exit-interval": 5}), 2)
    assert first == straight[:5]
    resumed = train(2, base_argv(corpus, cache, **flags, **{"--load": save}), 2)
    assert resumed == straight[5:]
    alone = train(1, base_argv(corpus, cache, **{**DP2, "--load": save}))
    assert len(alone) == 5
    for got, want in zip(alone, straight[5:]):
        for value, ref in zip(got, want):
            assert math.isclose(value, ref, rel_tol=1e-5), (got, want)


def test_bf16_ring_stays_close_to_one_bf16_process(corpus, tmp_path):
    """bf16 (tiny: half precision is slow on a CPU): the ring merges its blocks in fp32, so
    the split run's losses stay within bf16's reach of the unsplit one's."""
    flags = {"--bf16": True, "--train-iters": 3}
    cache = str(tmp_path / "cache")
    expected = train(1, base_argv(corpus, cache, **flags))
    got = train(2, base_argv(corpus, cache, **flags, **_cp(2)), 2)
    assert len(got) == len(expected) == 3
    for (loss, *_), (ref, *_) in zip(got, expected):
        assert math.isfinite(loss) and math.isclose(loss, ref, rel_tol=1e-2), (loss, ref)

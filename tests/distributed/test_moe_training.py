"""A mixture-of-experts GPT (4 experts, top-2, dropless, load-balancing and z losses) trains
through the real pretrain() entry for 10 iterations, and every layout (tensor, sequence,
data with the distributed optimizer, pipeline, expert parallel 2 and 4 with both dispatchers,
grouped GEMM, loss-free balancing) equals the one-process run within 1e-5 relative: losses,
both router losses, the expert load and grad norms. --ckpt-format torch checkpoints resume
the same run at their own and at other expert layouts."""

import math

import pytest

import pretrain_gpt
from tests.dist_utils import run_distributed
from tests.distributed import training_utils
from tools.checkpoint import convert

ITERS = 10
SAVED = 5  # the checkpoint tests save here and resume to ITERS
MOE = {"--num-experts": 4, "--moe-router-topk": 2, "--moe-aux-loss-coeff": 0.01,
       "--moe-z-loss-coeff": 1e-3, "--moe-ffn-hidden-size": 64}
NAMES = ("lm loss", "load_balancing_loss", "z_loss", "expert load imbalance")


def argv(corpus, cache, **overrides):
    return training_utils.base_argv(corpus, cache, **{
        "--global-batch-size": 8, "--train-iters": ITERS, "--lr": 1e-3, "--min-lr": 1e-4,
        "--lr-warmup-iters": 1, "--lr-decay-iters": ITERS, **MOE, **overrides})


def _train(rank, world_size, argv):
    state = pretrain_gpt.main(argv)
    for h in state.history:  # every expert's share of the routing slots, over all ranks
        shares = [h["losses"][f"expert {j} token share"] for j in range(4)]
        assert math.isclose(sum(shares), 1.0, rel_tol=1e-9)
        assert math.isclose(max(shares) * 4, h["losses"]["expert load imbalance"])
    return [[h["losses"][n] for n in NAMES] + [h["grad_norm"]] for h in state.history]


def train(world_size, argv):
    histories = run_distributed(_train, world_size, argv)
    for other in histories[1:]:
        assert other == histories[0]
    return histories[0]


def assert_same_run(got, expected, rel=1e-5):
    """Losses, router losses, the expert load (the same routing: exactly) and grad norms."""
    assert len(got) == len(expected)
    for i, (step, ref) in enumerate(zip(got, expected)):
        for name, value, want in zip((*NAMES, "grad norm"), step, ref):
            assert math.isclose(value, want, rel_tol=rel), (i, name, value, want)


@pytest.fixture(scope="module")
def reference(corpus, cache):
    run = train(1, argv(corpus, cache))
    losses = [step[0] for step in run]
    assert losses[-1] < losses[0], "the MoE model does not learn"
    for step in run:  # the load-balancing loss is about 1 (its value at balance) here
        assert 0.9 < step[1] < 1.5 and step[2] > 0
    return run


@pytest.mark.parametrize("world, layout", [
    (2, {"--tensor-model-parallel-size": 2}),
    (2, {"--use-distributed-optimizer": True}),
    (2, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}),
    # Buckets reduced while the backward runs (2 micro-batches a rank; the same micro-batch
    # size, since the router losses are each micro-batch's).
    (2, {"--overlap-grad-reduce": True}),
    (1, {"--recompute-granularity": "full", "--recompute-method": "uniform"}),
    # Expert parallelism: each rank holds 4 / N experts, tokens travel to them and back.
    (2, {"--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall"}),
    (2, {"--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "allgather"}),
    (4, {"--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    (4, {"--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall",
         "--tensor-model-parallel-size": 2, "--sequence-parallel": True}),
    (4, {"--moe-expert-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall",
         "--use-distributed-optimizer": True, "--overlap-grad-reduce": True}),
    (4, {"--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "allgather",
         "--use-distributed-optimizer": True}),
    # Pipeline stages each hold a layer with experts; the router losses are averaged over
    # the layers of both stages.
    (2, {"--pipeline-model-parallel-size": 2}),
    (4, {"--pipeline-model-parallel-size": 2, **{"--expert-model-parallel-size": 2,
         "--moe-token-dispatcher-type": "alltoall"}}),
    (8, {"--pipeline-model-parallel-size": 2, "--tensor-model-parallel-size": 2,
         "--expert-model-parallel-size": 2, "--use-distributed-optimizer": True}),
    (4, {"--tensor-model-parallel-size": 2, "--expert-model-parallel-size": 2,
         "--moe-grouped-gemm": True}),
], ids=["tp2", "dp2-distopt", "tp2-seqpar", "dp2-overlap", "full-recompute", "ep2-a2a",
        "ep2-allgather", "ep4-a2a", "ep2-tp2-seqpar", "ep2-dp4-distopt-overlap",
        "ep2-allgather-dp4-distopt", "pp2", "pp2-ep2", "pp2-tp2-ep2-distopt", "tp2-ep2-grouped-gemm"])
def test_moe_layout_matches_single_process(corpus, cache, reference, world, layout):
    assert_same_run(train(world, argv(corpus, cache, **layout)), reference)


@pytest.mark.parametrize("saved_tp, loaded_tp", [(1, 1), (2, 1)], ids=["same", "tp2-to-tp1"])
def test_moe_checkpoint_resumes_the_same_run(corpus, cache, reference, tmp_path, saved_tp,
                                             loaded_tp):
    """Expert weights are cut over tensor ranks like the MLP's: a tp 2 checkpoint resumes at
    tp 1 too."""
    save = str(tmp_path / "ckpt")
    first = train(saved_tp, argv(corpus, cache, **{
        "--train-iters": SAVED, "--save": save, "--save-interval": SAVED, "--ckpt-format": "torch",
        "--tensor-model-parallel-size": saved_tp}))
    assert_same_run(first, reference[:SAVED])
    if loaded_tp != saved_tp:  # Megatron-LM's converter interface reshards it
        resharded = str(tmp_path / f"ckpt_tp{loaded_tp}")
        assert convert.main(["--model-type", "GPT", "--loader", "megatron", "--saver",
                             "megatron", "--load-dir", save, "--save-dir", resharded,
                             "--target-tensor-parallel-size", str(loaded_tp),
                             "--target-pipeline-parallel-size", "1"]) == 0
        save = resharded
    resumed = train(loaded_tp, argv(corpus, cache, **{
        "--load": save, "--tensor-model-parallel-size": loaded_tp}))
    assert_same_run(resumed, reference[SAVED:])


EP2 = {"--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall"}


@pytest.mark.parametrize("saved, loaded", [
    ((2, EP2), (2, EP2)),
    ((2, EP2), (1, {})),
    ((1, {}), (4, {**EP2, "--moe-token-dispatcher-type": "allgather"})),
    ((4, {**EP2, "--use-distributed-optimizer": True}),
     (4, {**EP2, "--use-distributed-optimizer": True})),
    ((4, {**EP2, "--use-distributed-optimizer": True}),
     (2, {"--use-distributed-optimizer": True})),
], ids=["ep2-same", "ep2-to-one-process", "one-process-to-ep2-dp4", "ep2-dp4-distopt-same",
        "ep2-dp4-distopt-to-dp2"])
def test_expert_parallel_checkpoints_load_at_any_expert_layout(corpus, cache, reference,
                                                               tmp_path, saved, loaded):
    """The file holds every expert under its global number, with the plain optimizer's state
    for all of them: it resumes the same run at the saved layout and at others."""
    save = str(tmp_path / "ckpt")
    (world, layout), (loaded_world, loaded_layout) = saved, loaded
    first = train(world, argv(corpus, cache, **{
        "--train-iters": SAVED, "--save": save, "--save-interval": SAVED, "--ckpt-format": "torch",
        **layout}))
    assert_same_run(first, reference[:SAVED])
    resumed = train(loaded_world, argv(corpus, cache, **{"--load": save, **loaded_layout}))
    assert_same_run(resumed, reference[SAVED:])


BIAS = {"--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": True,
        "--moe-router-bias-update-rate": 0.05}


@pytest.fixture(scope="module")
def biased_reference(corpus, cache):
    return train(1, argv(corpus, cache, **BIAS))


@pytest.mark.parametrize("world, layout", [
    (2, {"--tensor-model-parallel-size": 2}),
    (4, {"--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall"}),
], ids=["tp2", "ep2-dp4"])
def test_loss_free_balancing_matches_single_process(corpus, cache, biased_reference, world,
                                                    layout, tmp_path):
    """--moe-router-enable-expert-bias: the biases move with every rank's token counts, the
    same in every layout; they are saved with the model and resume the same run."""
    save = str(tmp_path / "ckpt")
    first = train(world, argv(corpus, cache, **BIAS, **layout, **{
        "--train-iters": SAVED, "--save": save, "--save-interval": SAVED,
        "--ckpt-format": "torch"}))
    assert_same_run(first, biased_reference[:SAVED])
    assert_same_run(train(world, argv(corpus, cache, **BIAS, **layout, **{"--load": save})),
                    biased_reference[SAVED:])


def _dropped(rank, world_size, argv):
    return [h["losses"]["dropped token fraction"] for h in pretrain_gpt.main(argv).history]


def test_dropped_fraction_is_the_same_at_expert_parallel_2(corpus, cache):
    """With a capacity the log reports the fraction of routing slots dropped: each rank
    drops among its own tokens, as one process does micro-batch by micro-batch."""
    flags = {"--moe-expert-capacity-factor": 1.0, "--train-iters": 2}
    one = run_distributed(_dropped, 1, argv(corpus, cache, **flags))[0]
    two = run_distributed(_dropped, 2, argv(corpus, cache, **flags, **EP2))[0]
    assert all(0 < d < 0.5 for d in one) and one == pytest.approx(two, rel=1e-12)

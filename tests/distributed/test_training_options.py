"""Megatron's run-management flags through the real pretrain() entry (one gloo rank):
--manual-gc, TensorBoard's optional scalars, --exit-on-missing-checkpoint, --train-tokens."""

import gc
import os

import pytest

import pretrain_gpt
from megatron.checkpointing import CheckpointError
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import base_argv, build_small_corpus, captured_stdout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")))


def _manual_gc_run(rank, world_size, argv):
    collections = []
    real_collect = gc.collect

    def counting_collect(*args):
        collections.append(gc.isenabled())
        return real_collect(*args)

    enabled_in_steps = set()

    def forward_step(ctx, data_iterator, model, stage):
        enabled_in_steps.add(gc.isenabled())
        return pretrain_gpt.forward_step(ctx, data_iterator, model, stage)

    gc.collect = counting_collect
    try:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 forward_step, argv=argv)
    finally:
        gc.collect = real_collect
    return {"collections": collections, "enabled_in_steps": sorted(enabled_in_steps),
            "enabled_after": gc.isenabled()}


def test_manual_gc_and_optional_tensorboard_scalars(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    argv = base_argv(corpus, str(tmp_path / "cache"), **{
        "--train-iters": 4, "--eval-interval": 2, "--eval-iters": 1, "--split": "80,20,0",
        "--manual-gc": True,
        "--manual-gc-interval": 2, "--tensorboard-dir": tb,
        "--log-world-size-to-tensorboard": True, "--no-log-loss-scale-to-tensorboard": True})
    (got,) = run_distributed(_manual_gc_run, 1, argv)
    # The collector is off for the whole run and back on afterwards; it ran once at the
    # start, at iterations 2 and 4, and before and after each of the 2 evaluations.
    assert got["enabled_in_steps"] == [False]
    assert got["enabled_after"]
    assert got["collections"] == [False] * (1 + 2 + 2 * 2)

    acc = EventAccumulator(tb, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "world-size" in tags and "loss-scale" not in tags, sorted(tags)
    assert [e.value for e in acc.Scalars("world-size")] == [1.0] * 4


def _load_missing(rank, world_size, argv):
    try:
        pretrain_gpt.main(argv)
    except CheckpointError as error:
        return str(error)
    return None


def test_exit_on_missing_checkpoint(corpus, tmp_path):
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    argv = base_argv(corpus, str(tmp_path / "cache"), **{
        "--train-iters": 2, "--lr-warmup-iters": 0, "--load": str(empty),
        "--exit-on-missing-checkpoint": True})
    (message,) = run_distributed(_load_missing, 1, argv)
    assert message is not None and "--exit-on-missing-checkpoint" in message
    assert str(empty) in message and "latest_checkpointed_iteration.txt" in message
    assert os.listdir(empty) == []


def _iterations_run(rank, world_size, argv):
    return [h["iteration"] for h in pretrain_gpt.main(argv).history]


@pytest.mark.parametrize("tokens, iterations", [(3 * 4 * 32, 3), (3 * 4 * 32 + 1, 4)])
def test_train_tokens_stops_training(corpus, tmp_path, tokens, iterations):
    # 4 sequences of 32 tokens per iteration: training stops once the tokens are consumed,
    # well before --train-iters.
    argv = base_argv(corpus, str(tmp_path / "cache"), **{
        "--train-iters": 10, "--train-tokens": tokens})
    (got,) = run_distributed(_iterations_run, 1, argv)
    assert got == list(range(1, iterations + 1))


def _timing_lines(rank, world_size, argv):
    with captured_stdout() as out:
        pretrain_gpt.main(argv)
    return [line for line in out.getvalue().splitlines() if "across ranks" in line
            or "time on each rank" in line]


@pytest.mark.parametrize("option, header", [
    ("minmax", "(min, max) time across ranks (ms) | "), ("all", "time on each rank (ms) | ")])
def test_timing_log_option_reports_every_rank(corpus, tmp_path, option, header):
    # Two pipeline stages: the last one runs the loss, so the ranks' timers differ.
    argv = base_argv(corpus, str(tmp_path / "cache"), **{
        "--train-iters": 3, "--log-interval": 1, "--pipeline-model-parallel-size": 2,
        "--timing-log-level": 1, "--timing-log-option": option})
    rank0, rank1 = run_distributed(_timing_lines, 2, argv)
    assert rank1 == []  # printed once, by rank 0
    assert len(rank0) == 3 and all(line.startswith(header) for line in rank0), rank0
    fields = dict(part.split(": ", 1) for part in rank0[0][len(header):].split(" | "))
    for name in ("forward-backward", "optimizer", "forward-compute", "pipeline-wait"):
        low, high = (float(v) for v in fields[name].strip("()").split(", "))
        assert 0.0 <= low and 0.0 <= high and (option == "all" or low <= high), (name, fields)

"""Pipeline configuration errors name the numbers; the bubble arithmetic and its log line."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, parse_args
from megatron.core.pipeline_parallel import bubble
from megatron.core.pipeline_parallel.schedules import (
    BACKWARD_TIMER,
    FORWARD_TIMER,
    WAIT_TIMER,
    check_interleaved_microbatches,
)


def flags(**overrides) -> list[str]:
    base = {"--num-layers": 8, "--hidden-size": 32, "--num-attention-heads": 4,
            "--seq-length": 32, "--micro-batch-size": 2, "--global-batch-size": 8,
            "--train-iters": 1, "--mock-data": True, "--tokenizer-type": "NullTokenizer",
            "--vocab-size": 100}
    base.update(overrides)
    argv = []
    for name, value in base.items():
        if value is not None:
            argv += [name] if value is True else [name, str(value)]
    return argv


def test_layers_not_divisible_by_stages():
    with pytest.raises(ConfigError, match=r"--num-layers \(10\) is not divisible by "
                                          r"--pipeline-model-parallel-size \(4\)"):
        parse_args(flags(**{"--num-layers": 10, "--pipeline-model-parallel-size": 4}),
                   world_size=4)


def test_uneven_split_that_does_not_fit():
    with pytest.raises(ConfigError, match=r"--num-layers \(8\) minus .*\(3\).* leaves 5 layers"):
        parse_args(flags(**{"--pipeline-model-parallel-size": 3,
                            "--decoder-first-pipeline-num-layers": 3}), world_size=3)


def test_virtual_stage_size_must_divide_the_stage():
    with pytest.raises(ConfigError, match=r"--num-layers-per-virtual-pipeline-stage \(3\) does "
                                          r"not divide .* = 2"):
        parse_args(flags(**{"--pipeline-model-parallel-size": 4,
                            "--num-layers-per-virtual-pipeline-stage": 3}), world_size=4)


@pytest.mark.parametrize("extra,message", [
    ({"--global-batch-size": 12}, r"global batch size 12 / \(--micro-batch-size \(2\) x "
                                  r"data-parallel size \(1\)\) = 6"),
    ({"--global-batch-size": 8, "--micro-batch-size": 1, "--rampup-batch-size": "4 2 100",
      "--train-iters": None, "--train-samples": 1000},
     r"global batch size 6 / \(--micro-batch-size \(1\) x data-parallel size \(1\)\) = 6"),
])
def test_interleaving_needs_micro_batches_multiple_of_stages(extra, message):
    argv = flags(**{"--pipeline-model-parallel-size": 4,
                    "--num-layers-per-virtual-pipeline-stage": 1, **extra})
    if "--rampup-batch-size" in extra:  # three values after one flag
        i = argv.index("--rampup-batch-size")
        argv[i + 1:i + 2] = extra["--rampup-batch-size"].split()
    # Checked while parsing, before any process group exists.
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size \(4\)") as error:
        parse_args(argv, world_size=4)
    assert error.match(message)


def test_schedule_refuses_a_bad_micro_batch_count():
    check_interleaved_microbatches(8, 4)
    with pytest.raises(ValueError, match=r"\(6\) .* --pipeline-model-parallel-size \(4\)"):
        check_interleaved_microbatches(6, 4)


@pytest.mark.parametrize("p,m,v,expected", [
    (2, 4, None, 1 / 5), (4, 8, None, 3 / 11), (4, 16, None, 3 / 19), (8, 8, None, 7 / 15),
    (4, 8, 2, 3 / 19), (4, 16, 2, 3 / 35), (1, 8, None, 0.0),
])
def test_theoretical_bubble(p, m, v, expected):
    assert bubble.theoretical_bubble_fraction(p, m, v) == pytest.approx(expected)


def test_measured_bubble_uses_the_longest_stage():
    # Two stages of 4 units of compute each; the schedule took 5 units on the slower one.
    stages = [bubble.StageTimes(forward=1.0, backward=3.0, wait=1.0, total=5.0),
              bubble.StageTimes(forward=1.5, backward=2.5, wait=0.2, total=4.5)]
    assert bubble.measured_bubble_fraction(stages) == pytest.approx(1 - 4.0 / 5.0)
    assert bubble.measured_bubble_fraction([]) == 0.0


def test_stage_times_from_timers_and_log_line():
    timings = {FORWARD_TIMER: 0.2, BACKWARD_TIMER: 0.4, WAIT_TIMER: 0.15,
               bubble.SCHEDULE_TIMER: 0.8, "optimizer": 1.0}
    times = bubble.StageTimes.from_timings(timings)
    assert times == bubble.StageTimes(0.2, 0.4, 0.15, 0.8)
    line = bubble.format_bubble([times, times], num_microbatches=4, iterations=2)
    assert "measured 25.0%" in line and "theoretical 20.0% (p=2, m=4, v=1)" in line
    assert "stage 1: fwd 100.0 bwd 200.0 wait 75.0 ms" in line

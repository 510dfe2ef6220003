import pytest

from megatron.core.timers import Timers, format_across_ranks

RANKS = [{"forward-backward": 0.010, "optimizer": 0.004},
         {"forward-backward": 0.030, "pipeline-wait": 0.002}]


def test_max_minmax_and_all_across_ranks():
    assert format_across_ranks(RANKS, "max", normalizer=2) == (
        "max time across ranks (ms) | forward-backward: 15.00 | optimizer: 2.00 | "
        "pipeline-wait: 1.00")
    assert format_across_ranks(RANKS, "minmax") == (
        "(min, max) time across ranks (ms) | forward-backward: (10.00, 30.00) | "
        "optimizer: (4.00, 4.00) | pipeline-wait: (2.00, 2.00)")
    assert format_across_ranks(RANKS, "all") == (
        "time on each rank (ms) | forward-backward: (10.00, 30.00) | optimizer: (4.00, -) | "
        "pipeline-wait: (-, 2.00)")
    with pytest.raises(ValueError, match="minmax"):
        format_across_ranks(RANKS, "mean")


def test_levels_and_one_rank():
    timers = Timers(log_level=1)
    timers("phase", log_level=1).start()
    timers("phase").stop()
    timers("detail", log_level=2).start()  # above the level: not recorded
    timers("detail", log_level=2).stop()
    seconds = timers.pop_all()
    assert list(seconds) == ["phase"] and seconds["phase"] >= 0.0
    assert format_across_ranks([{"phase": 0.5}], "minmax", normalizer=5) == (
        "(min, max) time across ranks (ms) | phase: (100.00, 100.00)")

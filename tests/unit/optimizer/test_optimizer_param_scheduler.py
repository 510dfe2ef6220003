import math

import pytest
import torch

from megatron.config import ConfigError, OptimizerConfig, SchedulerConfig
from megatron.core.optimizer_param_scheduler import (
    OptimizerParamScheduler,
    ScheduleMismatchError,
    build_optimizer_param_scheduler,
)


class FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 2.0, "wd_mult": 0.0}]


def make(style="linear", **kw):
    args = dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_decay_steps=110,
                lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=100,
                wd_incr_style="constant")
    args.update(kw)
    return OptimizerParamScheduler(FakeOptimizer(), **args)


def lr_at(sched, step):
    sched.num_steps = 0
    sched.step(step)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("style, points", [
    ("linear", {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 111: 0.1, 500: 0.1}),
    ("cosine", {5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1), 60: 0.55,
                110: 0.1, 200: 0.1}),
    ("constant", {5: 0.5, 10: 1.0, 60: 1.0, 500: 1.0}),
    ("inverse-square-root", {5: 0.5, 10: 1.0, 40: 0.5, 100: math.sqrt(0.1), 111: 0.1}),
])
def test_lr_curves(style, points):
    sched = make(style)
    for step, expected in points.items():
        assert lr_at(sched, step) == pytest.approx(expected, abs=1e-12), (style, step)


def test_warmup_starts_at_init_lr_and_multipliers_apply():
    sched = make(init_lr=0.2)
    assert lr_at(sched, 5) == pytest.approx(0.6)
    groups = sched.optimizer.param_groups
    assert groups[1]["lr"] == pytest.approx(1.2)
    assert groups[0]["weight_decay"] == pytest.approx(0.1)
    assert groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("style, at25, at50", [
    ("linear", 0.025, 0.05),
    ("cosine", 0.1 * 0.5 * (math.cos(math.pi * 0.75) + 1), 0.05),
])
def test_weight_decay_increment(style, at25, at50):
    sched = make(start_wd=0.0, end_wd=0.1, wd_incr_style=style)
    for step, expected in ((0, 0.0), (25, at25), (50, at50), (100, 0.1), (150, 0.1)):
        sched.num_steps = step
        assert sched.get_wd() == pytest.approx(expected, abs=1e-12)


def test_invalid_settings_raise():
    with pytest.raises(ConfigError, match="shorter than the decay"):
        make(lr_warmup_steps=200)
    with pytest.raises(ConfigError, match="--weight-decay-incr-style constant"):
        make(start_wd=0.0, end_wd=0.1)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        make(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)


def test_state_dict_round_trip():
    sched = make("cosine")
    sched.step(37)
    restored = make("cosine")
    restored.load_state_dict(sched.state_dict())
    assert restored.num_steps == 37
    assert restored.get_lr() == sched.get_lr()
    assert restored.optimizer.param_groups[0]["lr"] == pytest.approx(sched.get_lr())


def test_checkpoint_values_and_flags():
    saved = make()
    saved.step(37)
    sd = saved.state_dict()

    with pytest.raises(ScheduleMismatchError, match="learning rate 2 here, 1 in the checkpoint "
                       r"\(--lr\).*--use-checkpoint-opt_param-scheduler.*"
                       "--override-opt_param-scheduler"):
        make(max_lr=2.0).load_state_dict(sd)

    overridden = make(max_lr=2.0, override_opt_param_scheduler=True)
    overridden.load_state_dict(sd)
    assert overridden.max_lr == 2.0 and overridden.num_steps == 37

    from_checkpoint = make(max_lr=2.0, lr_decay_style="cosine",
                           use_checkpoint_opt_param_scheduler=True)
    from_checkpoint.load_state_dict(sd)
    assert from_checkpoint.max_lr == 1.0 and from_checkpoint.lr_decay_style == "linear"
    assert from_checkpoint.get_lr() == pytest.approx(saved.get_lr())


def test_loads_old_megatron_key_names():
    old = {"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 10, "end_iter": 110,
           "decay_style": "linear", "num_iters": 60}
    sched = make()
    sched.load_state_dict(old)
    assert sched.get_lr() == pytest.approx(0.55)


def test_token_based_decay_after_step_warmup():
    sched = make(lr_decay_tokens=1000)
    sched.step(10, token_num=100)  # warmup ends at 100 tokens
    assert sched.get_lr() == pytest.approx(1.0)
    sched.step(5, token_num=550)
    assert sched.get_lr() == pytest.approx(0.55)  # half-way from 100 to 1000 tokens
    restored = make(lr_decay_tokens=1000)
    restored.load_state_dict(sched.state_dict())
    assert restored.get_lr() == pytest.approx(0.55)
    sched.step(1, token_num=1001)
    assert sched.get_lr() == pytest.approx(0.1)


def build(train_iters=None, train_samples=None, **flags):
    sc = SchedulerConfig(**flags)
    return build_optimizer_param_scheduler(sc, OptimizerConfig(lr=1.0, min_lr=0.1), FakeOptimizer(),
                                           global_batch_size=8, train_iters=train_iters,
                                           train_samples=train_samples)


def test_build_resolves_iterations_into_samples():
    s = build(train_iters=100, lr_warmup_fraction=0.1)
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps) == (800, 80, 800)
    s = build(train_iters=100, lr_decay_iters=50, lr_warmup_iters=5)
    assert (s.lr_decay_steps, s.lr_warmup_steps) == (400, 40)
    assert s.start_wd == s.end_wd == OptimizerConfig().weight_decay


def test_build_sample_based():
    s = build(train_samples=1000, lr_warmup_samples=100, lr_decay_style="cosine")
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps) == (1000, 100, 1000)
    s.step(8 * 12)  # 96 samples: still warming up
    assert s.get_lr() == pytest.approx(0.96)
    s.step(550 - 96)  # half-way through the decay
    assert s.get_lr() == pytest.approx(0.55)


def test_build_rejects_mixed_units():
    with pytest.raises(ConfigError, match="--train-iters"):
        build(train_iters=100, lr_decay_samples=10)
    with pytest.raises(ConfigError, match="--train-samples"):
        build(train_samples=100, lr_warmup_iters=1)
    with pytest.raises(ConfigError, match="exactly one"):
        build()


def test_config_validation_names_flags():
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        SchedulerConfig(lr_decay_style="exponential")
    with pytest.raises(ConfigError, match="--lr-warmup-fraction"):
        SchedulerConfig(lr_warmup_fraction=0.1, lr_warmup_iters=3)
    with pytest.raises(ConfigError, match="--min-lr"):
        OptimizerConfig(lr=0.1, min_lr=0.2)
    with pytest.raises(ConfigError, match="--adam-beta2"):
        OptimizerConfig(adam_beta2=1.0)
    assert torch.float16 == OptimizerConfig(fp16=True).params_dtype


def test_a_longer_run_resumes_where_the_schedule_is_unchanged():
    """--train-iters 100 -> 200 with --lr-decay-iters 100: only the weight-decay increment
    length differs, and a constant weight decay does not use it: the resume just works."""
    first = build(train_iters=100, lr_decay_iters=100)
    first.step(8 * 60)
    longer = build(train_iters=200, lr_decay_iters=100)
    longer.load_state_dict(first.state_dict())
    assert longer.num_steps == 480 and longer.get_lr() == pytest.approx(first.get_lr())
    assert longer.wd_incr_steps == 1600  # this run's length


def test_a_longer_run_whose_decay_follows_train_iters_names_the_flags():
    first = build(train_iters=100)
    first.step(8 * 60)
    with pytest.raises(ScheduleMismatchError) as info:
        build(train_iters=200).load_state_dict(first.state_dict())
    message = str(info.value)
    assert ("decay length 200 iterations here, 100 in the checkpoint (--lr-decay-iters / "
            "--lr-decay-samples (default: --train-iters / --train-samples))") in message
    assert "weight-decay increment length" not in message  # constant: it changes nothing
    for name, flag in (("use_checkpoint", "--use-checkpoint-opt_param-scheduler"),
                       ("override", "--override-opt_param-scheduler")):
        assert flag in message
        resumed = build(train_iters=200, **{f"{name}_opt_param_scheduler": True})
        resumed.load_state_dict(first.state_dict())
        assert resumed.num_steps == 480
        assert resumed.lr_decay_steps == (800 if name == "use_checkpoint" else 1600)

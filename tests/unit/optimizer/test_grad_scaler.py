import torch

from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler


def scale(s) -> float:
    return float(s.scale)


def test_hysteresis_backoff_and_growth():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert scale(s) == 8.0  # the first overflow only uses up hysteresis
    s.update(True)
    assert scale(s) == 4.0
    s.update(False)
    s.update(False)
    assert scale(s) == 4.0
    s.update(True)  # hysteresis is only restored by growth: this overflow halves at once
    assert scale(s) == 2.0
    for _ in range(3):
        s.update(False)
    assert scale(s) == 4.0  # three clean steps in a row grow the scale ...
    s.update(True)
    assert scale(s) == 4.0  # ... and restore the hysteresis


def test_growth_needs_consecutive_clean_steps():
    s = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, growth_interval=2, hysteresis=5)
    s.update(False)
    s.update(True)
    s.update(False)
    assert scale(s) == 4.0
    s.update(False)
    assert scale(s) == 8.0


def test_scale_never_below_minimum():
    s = DynamicGradScaler(initial_scale=2.0, min_scale=1.0, hysteresis=1)
    for _ in range(4):
        s.update(True)
    assert scale(s) == 1.0
    assert float(s.inv_scale) == 1.0


def test_state_dict_round_trip():
    s = DynamicGradScaler(initial_scale=16.0, min_scale=1.0, growth_interval=5, hysteresis=2)
    s.update(True)
    s.update(True)
    s.update(False)
    t = DynamicGradScaler(initial_scale=2.0**32, min_scale=1.0, growth_interval=5, hysteresis=2)
    t.load_state_dict(s.state_dict())
    for found_inf in (False, False, False, False, True):
        s.update(found_inf)
        t.update(found_inf)
        assert scale(s) == scale(t)
    assert scale(t) == 16.0


def test_constant_scaler():
    s = ConstantGradScaler(128.0)
    s.update(True)
    s.update(False)
    assert scale(s) == 128.0
    assert torch.equal(s.inv_scale, torch.tensor([1.0 / 128]))
    s.load_state_dict(s.state_dict())

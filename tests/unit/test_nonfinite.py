"""megatron.core.nonfinite in one process: finding a NaN/Inf loss, counting non-finite iterations,
and refusing to save NaN/Inf parameters or optimizer state."""

import math

import pytest
import torch

from megatron.config import ConfigError, OptimizerConfig
from megatron.core.distributed import DistributedDataParallel
from megatron.core.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    OverflowGuard,
    _ranges,
    check_finite_for_save,
    first_nonfinite,
    grads_are_finite,
    locate_nonfinite_loss,
    ranks_where,
)
from megatron.core.optimizer import get_megatron_optimizer

NAN, INF = float("nan"), float("inf")


def _losses(*values):
    return [{"lm loss": torch.as_tensor(v)} for v in values]


def test_locate_nonfinite_loss_finds_the_first_micro_batch():
    assert locate_nonfinite_loss([]) is None  # a stage without losses
    assert locate_nonfinite_loss(_losses(2.0, 3.0)) is None
    assert locate_nonfinite_loss(_losses(2.0, NAN, INF)) == (0, 1)
    assert locate_nonfinite_loss(_losses(-INF, 1.0)) == (0, 0)
    # Every reported value counts, whatever its name or shape.
    losses = [{"lm loss": torch.tensor(1.0), "z": torch.tensor([1.0, 2.0])},
              {"lm loss": torch.tensor(1.0), "z": torch.tensor([1.0, NAN])}]
    assert locate_nonfinite_loss(losses) == (0, 1)
    assert locate_nonfinite_loss(_losses(torch.tensor(INF, dtype=torch.bfloat16))) == (0, 0)


def test_ranks_where_and_ranges():
    assert ranks_where(True) == [0] and ranks_where(False) == []
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert _ranges([3]) == "3"


def test_guard_counts_iterations_in_a_row_and_resets_on_a_finite_one():
    guard = NonFiniteGuard(max_consecutive=3)
    assert guard.observe(1, None) is None and not guard.in_nonfinite_run
    warning = guard.observe(2, "the loss of micro-batch 1 (counted from 0, of 4) on rank 3")
    assert warning.startswith("WARNING: iteration 2: the loss of micro-batch 1")
    assert "1 in a row" in warning and "--max-consecutive-nonfinite-iterations" in warning
    assert guard.in_nonfinite_run and not guard.must_stop
    guard.observe(3, "x")
    assert guard.observe(4, None) is None and guard.consecutive == 0
    for it in (5, 6, 7):
        guard.observe(it, "the grad norm (nan)")
    assert guard.must_stop
    message = str(guard.stop_error(7, "/ckpt", 4))
    assert message.startswith("3 iterations in a row (5-7) had a NaN/Inf loss or grad norm")
    assert "the latest checkpoint in --save /ckpt is iteration 4" in message
    assert "no --save given" in str(guard.stop_error(7, None, None))
    assert "saved no checkpoint" in str(guard.stop_error(7, "/ckpt", None))


def test_guard_limit_must_be_positive():
    with pytest.raises(ConfigError, match="--max-consecutive-nonfinite-iterations"):
        NonFiniteGuard(max_consecutive=0)


def _model_and_optimizer(**flags):
    torch.manual_seed(0)
    config = OptimizerConfig(lr=0.01, **flags)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    model = DistributedDataParallel(model.to(config.params_dtype))
    optimizer = get_megatron_optimizer(config, model)
    model(torch.randn(3, 4).to(config.params_dtype)).float().sum().backward()
    optimizer.step()  # creates the optimizer state
    return model, optimizer


def test_save_check_passes_finite_state_and_names_a_nonfinite_parameter():
    model, optimizer = _model_and_optimizer()
    check_finite_for_save([model], optimizer, 5)
    with torch.no_grad():
        model.module[1].bias[0] = NAN
    with pytest.raises(NonFiniteError, match=r"refusing to save the checkpoint of iteration 5: "
                                             r"parameter 1\.bias on rank 0 holds NaN/Inf"):
        check_finite_for_save([model], optimizer, 5)


def test_save_check_reads_optimizer_state_and_fp32_main_copies():
    model, optimizer = _model_and_optimizer(bf16=True)
    assert first_nonfinite([model], optimizer) is None
    next(iter(optimizer.state.values()))["exp_avg_sq"][0] = INF
    assert first_nonfinite([model], optimizer) == "optimizer state 'exp_avg_sq' of main parameter 0"
    model, optimizer = _model_and_optimizer(bf16=True)
    optimizer.get_main_params()[2].data.view(-1)[0] = NAN
    assert first_nonfinite([model], optimizer) == "fp32 main parameter 2 of the optimizer"


def test_save_check_catches_fp16_parameters_that_overflowed():
    # An fp32 main value past 65504 is finite, its fp16 model copy is not.
    model, optimizer = _model_and_optimizer(fp16=True, initial_loss_scale=1.0)
    optimizer.get_main_params()[0].data.fill_(1e6)
    optimizer._copy_main_params_to_model_params()
    assert math.isinf(model.module[0].weight[0, 0].item())
    assert first_nonfinite([model], optimizer) == "parameter 0.weight"


def test_grads_are_finite_reads_the_data_parallel_buffer():
    model, _ = _model_and_optimizer()
    model(torch.randn(3, 4)).sum().backward()
    assert grads_are_finite([model])
    model.module[0].weight.main_grad[0, 0] = NAN
    assert not grads_are_finite([model])
    # Every gradient counts, not only the first one.
    model.module[0].weight.main_grad.zero_()
    assert grads_are_finite([model])
    last = list(model.parameters())[-1]
    last.main_grad.view(-1)[-1] = NAN
    assert not grads_are_finite([model])


def test_all_finite_finds_nan_and_inf_anywhere_and_takes_large_values_as_finite():
    from megatron.core.nonfinite import _all_finite

    big = torch.full((2500,), 3e38)  # its fp32 sum would overflow
    assert _all_finite([big, torch.ones(3), torch.ones(0)]) == [True, True, True]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for where, bad in ((0, NAN), (1999, float("inf")), (2499, float("-inf"))):
            broken = torch.ones(2500, dtype=dtype)
            broken[where] = bad
            assert _all_finite([torch.ones(3), broken]) == [True, False], (dtype, where)


def test_overflow_guard_counts_only_overflows_the_scaler_cannot_back_off_from():
    dynamic = OverflowGuard(3, static_scale=None, min_scale=1.0)
    # Backing off from 2**32 (the first iterations of an fp16 run) is not counted.
    for it, scale in enumerate((2.0**32, 2.0**31, 4.0, 2.0), start=1):
        assert dynamic.observe(it, overflowed=True, scale=scale) is None
    warning = dynamic.observe(5, overflowed=True, scale=1.0)
    assert ("iteration 5: fp16 overflow; the loss scaler skipped the step and cannot back off: "
            "its scale is at the minimum, 1 (--min-loss-scale). 1 in a row; the run stops at 3 "
            "(--max-consecutive-nonfinite-iterations)") in warning
    assert dynamic.observe(6, overflowed=False, scale=1.0) is None  # an applied step resets
    for it in (7, 8, 9):
        dynamic.observe(it, overflowed=True, scale=1.0)
    assert dynamic.must_stop
    message = str(dynamic.stop_error(9))
    assert "3 iterations in a row (7-9) overflowed in fp16" in message
    assert "no update has been applied since iteration 6" in message and "--bf16" in message

    static = OverflowGuard(2, static_scale=1e9, min_scale=1.0)
    assert "its scale is fixed at 1e+09 (--loss-scale)" in static.observe(1, True, 1e9)
    static.observe(2, True, 1e9)
    assert static.must_stop and "Drop --loss-scale" in str(static.stop_error(2))

import copy
import math

import pytest
import torch
from torch import nn

from megatron.config import ConfigError, OptimizerConfig
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads, unwrap_model
from megatron.core.optimizer import (
    FP32Optimizer,
    MixedPrecisionOptimizer,
    get_megatron_optimizer,
    get_param_groups,
)


def build_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def loss_of(model, x, y):
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def train(model, opt, steps, x, y, micro_batches=1):
    """Megatron's step: zero, backward per micro-batch, finalize, step. Returns losses, results."""
    losses, results = [], []
    for _ in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            loss = loss_of(model, xm, ym) / micro_batches
            if i < micro_batches - 1:
                with model.no_sync():
                    opt.scale_loss(loss).backward()
            else:
                opt.scale_loss(loss).backward()
            total += loss.item()
        finalize_model_grads([model])
        results.append(opt.step())
        losses.append(total)
    return losses, results


def test_param_groups_follow_megatron_rules():
    model = build_model()
    groups = get_param_groups([model], weight_decay=0.1, lr=1e-3)
    assert [(g["wd_mult"], g["lr_mult"]) for g in groups] == [(1.0, 1.0), (0.0, 1.0)]
    assert [p.ndim for p in groups[0]["params"]] == [2, 2]
    assert len(groups[1]["params"]) == 4  # two biases and the LayerNorm weight and bias
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["weight_decay"] == 0.1

    groups = get_param_groups([model], 0.1, 1e-3, no_weight_decay_cond=lambda n, p: False,
                              scale_lr_cond=lambda n, p: n.startswith("3."), lr_mult=10.0)
    assert [(g["wd_mult"], g["lr_mult"], len(g["params"])) for g in groups] == [
        (1.0, 1.0, 4), (1.0, 10.0, 2)]
    assert groups[1]["lr"] == pytest.approx(1e-2)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_fp32_optimizer_matches_torch(kind):
    x, y = batch()
    model, ref = build_model(), build_model()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=kind, lr=0.01, weight_decay=0.1,
                                                 clip_grad=0.0), model)
    assert isinstance(opt, FP32Optimizer)
    groups = get_param_groups([ref], 0.1, 0.01)
    ref_opt = (torch.optim.AdamW(groups, lr=0.01) if kind == "adam"
               else torch.optim.SGD(groups, lr=0.01, momentum=0.9))
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        ok, norm, zeros = opt.step()
        assert ok and norm > 0 and zeros is None  # the norm is the non-finite guard's
        ref_opt.zero_grad()
        loss_of(ref, x, y).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_equals_one_big_batch():
    x, y = batch(n=16)
    config = OptimizerConfig(lr=0.01, clip_grad=1.0)
    big = DistributedDataParallel(build_model())
    accum = DistributedDataParallel(build_model(), overlap_grad_reduce=True, bucket_size=32)
    _, big_results = train(big, get_megatron_optimizer(config, big), 3, x, y)
    _, accum_results = train(accum, get_megatron_optimizer(config, accum), 3, x, y, micro_batches=4)
    for (_, a, _), (_, b, _) in zip(big_results, accum_results):
        assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip(big.parameters(), accum.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_ddp_buffer_views_and_pass_through():
    model = build_model()
    ddp = DistributedDataParallel(model, accumulate_allreduce_grads_in_fp32=True)
    assert unwrap_model(ddp) is model and ddp.module is model
    (buffer,) = ddp.buffers
    assert buffer.grad_data.numel() == sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.main_grad.shape == p.shape
        assert p.main_grad.untyped_storage().data_ptr() == buffer.grad_data.untyped_storage().data_ptr()
    x, y = batch()
    with ddp.no_sync():
        loss_of(ddp, x, y).backward()
        loss_of(ddp, x, y).backward()
    assert all(p.grad is None for p in model.parameters())  # moved into main_grad
    single = build_model()
    loss_of(single, x, y).backward()
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p.main_grad, 2 * q.grad)
    ddp.zero_grad_buffer()
    assert buffer.grad_data.abs().sum() == 0
    assert ddp.state_dict().keys() == model.state_dict().keys()
    model.set_input_tensor = lambda tensor: tensor  # as pipeline stages have
    assert ddp.set_input_tensor(3) == 3  # attributes fall through to the wrapped model


def test_ddp_keeps_low_precision_grads_without_fp32_accumulation():
    ddp = DistributedDataParallel(build_model(torch.bfloat16), accumulate_allreduce_grads_in_fp32=False)
    assert ddp.buffers[0].grad_data.dtype == torch.bfloat16
    ddp = DistributedDataParallel(build_model(torch.bfloat16))
    assert ddp.buffers[0].grad_data.dtype == torch.float32


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("distributed", [False, True])
def test_mixed_precision_trains(precision, distributed):
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    config = OptimizerConfig(lr=0.02, initial_loss_scale=2.0**12,
                             use_distributed_optimizer=distributed, **{precision: True})
    model = DistributedDataParallel(build_model(dtype), use_distributed_optimizer=distributed)
    opt = get_megatron_optimizer(config, model)
    losses, results = train(model, opt, 40, *batch())
    assert losses[-1] < 0.3 * losses[0]
    assert all(ok for ok, _, _ in results)
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in opt.get_main_params())
    expected_scale = 2.0**12 if precision == "fp16" else 1.0
    assert float(opt.get_loss_scale()) == expected_scale


def _step_with_inf(model, opt, inject: bool):
    x, y = batch()
    model.zero_grad_buffer()
    opt.zero_grad()
    opt.scale_loss(loss_of(model, x, y)).backward()
    finalize_model_grads([model])
    if inject:
        model.module[0].weight.main_grad[0, 0] = float("inf")
    return opt.step()


def test_fp16_overflow_skips_step_with_hysteresis():
    config = OptimizerConfig(lr=0.01, fp16=True, initial_loss_scale=1024.0, hysteresis=2)
    model = DistributedDataParallel(build_model(torch.float16))
    opt = get_megatron_optimizer(config, model)
    assert isinstance(opt, MixedPrecisionOptimizer)
    assert _step_with_inf(model, opt, inject=False)[0]
    before = [p.detach().clone() for p in model.parameters()]
    assert _step_with_inf(model, opt, inject=True) == (False, None, None)
    assert float(opt.get_loss_scale()) == 1024.0  # hysteresis absorbs the first overflow
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _step_with_inf(model, opt, inject=True) == (False, None, None)
    assert float(opt.get_loss_scale()) == 512.0
    assert _step_with_inf(model, opt, inject=False)[0]
    assert _step_with_inf(model, opt, inject=True)[0] is False
    assert float(opt.get_loss_scale()) == 256.0  # no growth yet, so no hysteresis left


def _optimizer_state(opt) -> list[torch.Tensor]:
    return [v.detach().clone() for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)] + [p.detach().clone() for p in opt.get_main_params()]


@pytest.mark.parametrize("flags", [dict(), dict(bf16=True),
                                   dict(bf16=True, use_distributed_optimizer=True)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_grad_norm_skips_the_step_and_changes_nothing(flags, bad):
    config = OptimizerConfig(lr=0.01, clip_grad=0.0, **flags)  # the norm is computed anyway
    model = DistributedDataParallel(build_model(config.params_dtype),
                                    use_distributed_optimizer=config.use_distributed_optimizer)
    opt = get_megatron_optimizer(config, model)
    assert _step_with_inf(model, opt, inject=False)[0]
    params = [p.detach().clone() for p in model.parameters()]
    state = _optimizer_state(opt)
    model.zero_grad_buffer()
    opt.zero_grad()
    loss_of(model, *batch()).backward()
    finalize_model_grads([model])
    model.module[0].weight.main_grad[0, 0] = bad
    ok, norm, zeros = opt.step()
    assert not ok and not math.isfinite(norm) and zeros is None
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(opt)))
    assert all(p.grad is None for p in opt.get_main_params())  # no alias of the buffer left
    assert _step_with_inf(model, opt, inject=False)[0]  # and training goes on


def test_without_the_check_a_nonfinite_step_is_applied_as_before():
    config = OptimizerConfig(lr=0.01, check_for_nan_in_loss_and_grad=False)
    model = DistributedDataParallel(build_model())
    opt = get_megatron_optimizer(config, model)
    ok, norm, _ = _step_with_inf(model, opt, inject=True)
    assert ok and math.isinf(norm)
    assert not torch.isfinite(model.module[0].weight).all()
    config = OptimizerConfig(lr=0.01, clip_grad=0.0, check_for_nan_in_loss_and_grad=False)
    opt = get_megatron_optimizer(config, DistributedDataParallel(build_model()))
    assert opt.step() == (True, None, None)  # no clipping, no check: no norm


def test_fp16_overflow_is_still_the_loss_scalers():
    # With the guard on, an fp16 overflow still backs the scale off and reports no norm
    # (the training loop does not count it as a non-finite step).
    config = OptimizerConfig(lr=0.01, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    model = DistributedDataParallel(build_model(torch.float16))
    opt = get_megatron_optimizer(config, model)
    assert _step_with_inf(model, opt, inject=True) == (False, None, None)
    assert float(opt.get_loss_scale()) == 512.0


@pytest.mark.parametrize("flags", [dict(), dict(fp16=True, initial_loss_scale=256.0),
                                   dict(bf16=True)])
def test_state_dict_round_trip_continues_identically(flags):
    config = OptimizerConfig(lr=0.01, **flags)
    dtype = config.params_dtype
    x, y = batch()
    model = DistributedDataParallel(build_model(dtype))
    opt = get_megatron_optimizer(config, model)
    train(model, opt, 3, x, y)
    opt_state = copy.deepcopy(opt.state_dict())
    model_state = copy.deepcopy(model.state_dict())
    train(model, opt, 2, x, y)

    resumed = DistributedDataParallel(build_model(dtype))
    resumed.load_state_dict(model_state)
    resumed_opt = get_megatron_optimizer(config, resumed)
    resumed_opt.load_state_dict(opt_state)
    train(resumed, resumed_opt, 2, x, y)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert float(opt.get_loss_scale()) == float(resumed_opt.get_loss_scale())


def test_reports_zeros_when_asked():
    config = OptimizerConfig(lr=0.01, log_num_zeros_in_grad=True)
    model = DistributedDataParallel(build_model())
    opt = get_megatron_optimizer(config, model)
    x, y = batch()
    model.zero_grad_buffer()
    loss_of(model, x, y).backward()
    model.module[0].weight.main_grad[:2] = 0.0  # 8 entries
    ok, norm, zeros = opt.step()
    assert ok and norm > 0 and zeros == 8


def test_builder_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), build_model())
    with pytest.raises(ConfigError, match="--use-distributed-optimizer"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1, use_distributed_optimizer=True),
                               build_model())


def test_params_norm_counts_every_parameter_once():
    model = build_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1), model)
    expected = torch.sqrt(sum((p.detach().double() ** 2).sum() for p in model.parameters()))
    assert abs(optimizer.params_norm() - float(expected)) < 1e-5 * float(expected)

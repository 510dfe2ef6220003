import math

import pytest
import torch
from torch import nn

from megatron.core.optimizer import clip_grad_norm_fp32, count_zeros_fp32, get_grad_norm_fp32


def params_with_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in ((5, 3), (3,), (2, 2)):
        p = nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g)
        params.append(p)
    params[1].grad[0] = 0.0
    return params


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_matches_torch_clip_grad_norm(max_norm, norm_type):
    ours, ref = params_with_grads(), params_with_grads()
    norm = clip_grad_norm_fp32(ours, max_norm, norm_type=norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    assert (norm > max_norm) == (max_norm == 0.5)


def test_shared_params_are_scaled_but_not_counted():
    params = params_with_grads()
    shared = nn.Parameter(torch.zeros(4))
    shared.grad = torch.full((4,), 10.0)
    shared.shared = True
    expected = get_grad_norm_fp32([p.grad for p in params])
    assert clip_grad_norm_fp32(params + [shared], 1.0) == pytest.approx(expected)
    torch.testing.assert_close(shared.grad, torch.full((4,), 10.0 / (expected + 1e-6)))


def test_count_zeros_and_missing_grads():
    params = params_with_grads()
    params.append(nn.Parameter(torch.zeros(3)))  # no grad: ignored
    assert count_zeros_fp32(params) == 1
    assert get_grad_norm_fp32([]) == 0.0


@pytest.mark.parametrize("norm_type", [2.0, 3.0])
def test_cpu_norm_is_fp64_accurate(norm_type):
    # A long fp32 gradient whose norm a plain fp32 reduction gets wrong by ~1e-3 on CPU.
    torch.manual_seed(0)
    grads = [torch.randn(4_000_003) + 0.5, torch.randn(7, 333)]
    exact = sum(float(g.double().abs().pow(norm_type).sum()) for g in grads) ** (1 / norm_type)
    rel = 1e-8 if norm_type == 2.0 else 1e-6  # fp32 |x|^3 rounds more
    assert get_grad_norm_fp32(grads, norm_type=norm_type) == pytest.approx(exact, rel=rel)
    # A split of the first gradient (as over tensor ranks) gives the same norm.
    halves = list(grads[0].split(1_999_999)) + grads[1:]
    assert get_grad_norm_fp32(halves, norm_type=norm_type) == pytest.approx(exact, rel=rel)

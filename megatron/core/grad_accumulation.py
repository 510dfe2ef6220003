"""Gradient-accumulation fusion: weight gradients added by the backward itself into the
data-parallel wrapper's ``main_grad`` buffer (Megatron's ``--gradient-accumulation-fusion``,
on by default, off with ``--no-gradient-accumulation-fusion``).

Without it a layer returns its weight gradient as a new tensor, autograd stores it in
``param.grad`` and the wrapper's hook adds it into ``main_grad``: one tensor of the weight's
size written, read back and freed per micro-batch. With it the weight-gradient matmul adds
into ``main_grad`` directly.

Under ``--bf16``/``--fp16`` ``main_grad`` is fp32 while the gradient matmul's inputs are
half precision. On CUDA that is one cuBLAS GEMM with half inputs and an fp32 C matrix
(``torch.addmm(..., out_dtype=torch.float32)``), which also keeps the product unrounded, as
Megatron's ``wgrad_gemm_accum_fp32`` kernel does. Whether the installed torch has that
overload for an fp32 C is checked once per device (``mixed_accumulation_works``) when the
wrapper is built; where it does not, half-precision weight gradients take the unfused path.
On the CPU the half product is added to ``main_grad``: the unfused path's numbers, without
the hook's round trip.

Which weights are fused is fixed when the wrapper is built: a weight is fused when its layer
declared it (``mark_layer_weight``) and the wrapper allowed it (``fuse_grad_accumulation``).
Such a weight's layer hands autograd either nothing or an unfilled stand-in (so the
wrapper's hook still runs, which overlapped reduction counts on), and the hook adds nothing.
So under the wrapper a marked weight must get its gradient through its layer (``linear``,
the vocab-parallel embedding, the fused LM-head loss): a gradient from, say, a direct
``F.linear(x, layer.weight)`` would be taken for a stand-in and dropped.
"""

from __future__ import annotations

from typing import Optional

import torch

_HALF = (torch.float16, torch.bfloat16)
_MIXED_WORKS: dict[tuple[str, Optional[int]], bool] = {}


def mixed_accumulation_works(device: torch.device) -> bool:
    """Whether ``accumulate_matmul_`` can add a half-precision product into an fp32 buffer
    on ``device``: always on the CPU; on CUDA when torch's fp32-output ``addmm`` accepts an
    fp32 ``input`` and gives the right numbers (tried once per device, a host sync)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    key = (device.type, device.index)
    if key not in _MIXED_WORKS:
        _MIXED_WORKS[key] = _try_mixed_addmm(device)
    return _MIXED_WORKS[key]


def _try_mixed_addmm(device: torch.device) -> bool:
    """The layers' call on operands laid out as theirs are: ``a`` the transpose of a
    contiguous ``[tokens, out]`` gradient, ``b`` contiguous ``[tokens, in]``, the fp32
    output a view into a flat buffer."""
    g = torch.Generator(device="cpu").manual_seed(0)
    grad, rows = (torch.randn(*shape, generator=g).to(device, torch.bfloat16)
                  for shape in ((32, 64), (32, 48)))
    flat = torch.randn(16 + 64 * 48, generator=g).to(device)
    c = flat[16:].view(64, 48)
    expected = c + grad.t().double().mm(rows.double()).float()
    try:
        torch.addmm(c, grad.t(), rows, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError):  # no such overload, or it wants a half-precision C
        return False
    return bool(torch.allclose(c, expected, rtol=1e-4, atol=1e-4))


def fusion_possible(param_dtype: torch.dtype, grad_dtype: torch.dtype,
                    device: torch.device) -> bool:
    """Whether gradients of a ``param_dtype`` weight can be accumulated in the backward into
    a ``grad_dtype`` buffer on ``device``. Never on an XLA device: its traced graph cannot
    hold the in-place custom operator, and XLA fuses the addition into the matmul itself."""
    if torch.device(device).type == "xla":
        return False
    if param_dtype == grad_dtype:
        return True
    return (grad_dtype == torch.float32 and param_dtype in _HALF
            and mixed_accumulation_works(device))


def main_grad_of(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``weight.main_grad`` when the backward adds the weight gradient into it, else None:
    then the gradient is returned to autograd as usual. It is the former exactly when the
    wrapper marked the weight ``fuse_grad_accumulation``, a fixed property of the weight, so
    the wrapper's hook knows without being told which gradients are already in the buffer
    (``layer_adds_grad``)."""
    if not getattr(weight, "fuse_grad_accumulation", False):
        return None
    return weight.main_grad


def mark_layer_weight(weight: torch.Tensor) -> None:
    """Declare that the layer owning ``weight`` adds its gradient into ``main_grad`` itself
    whenever ``main_grad_of`` gives one (linear, embedding and LM-head weights)."""
    weight.layer_adds_grad = True


def grad_already_added(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient reaches the buffer from its layer's backward, so that
    what autograd hands the wrapper's hook is only a stand-in."""
    return (getattr(param, "layer_adds_grad", False)
            and getattr(param, "fuse_grad_accumulation", False))


def accumulate_matmul_(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``main_grad += a @ b`` (``a``, ``b`` of one dtype, ``main_grad`` theirs or fp32)."""
    if a.dtype == main_grad.dtype:
        main_grad.addmm_(a, b)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
    else:  # the CPU: the half product, added
        main_grad.add_(torch.mm(a, b))


@torch.library.custom_op("megatron::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: torch.Tensor, grad: torch.Tensor,
                           x: torch.Tensor) -> None:
    """``main_grad += grad^T @ x`` (``grad`` ``[tokens, out]``, ``x`` ``[tokens, in]``) as
    one opaque operator: torch.compile keeps it in the traced backward as it is (a mutation
    of ``main_grad``), so compiled layers keep the fusion and its CUDA kernel."""
    accumulate_matmul_(main_grad, grad.t(), x)


@accumulate_weight_grad.register_fake
def _(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    return None


def accumulate_rows_(main_grad: torch.Tensor, index: torch.Tensor,
                     rows: torch.Tensor) -> None:
    """``main_grad[index[i]] += rows[i]`` for every i (an embedding's weight gradient), in
    ``main_grad``'s dtype, so repeated ids sum in fp32 under mixed precision."""
    main_grad.index_add_(0, index, rows.to(main_grad.dtype))


def mark_for_fusion(params, grad_dtype: torch.dtype, enabled: bool) -> None:
    """Tell the layers whether each parameter's gradient may go straight into ``main_grad``
    (called by the data-parallel wrapper after it made the buffers)."""
    for p in params:
        p.fuse_grad_accumulation = (enabled and not getattr(p, "fusion_refused", False)
                                    and fusion_possible(p.dtype, grad_dtype, p.device))


def refuse_fusion(param: torch.Tensor) -> None:
    """Keep ``param``'s gradient on the unfused path, whether or not a wrapper marked it
    already (a weight of a layer compiled by a torch that cannot keep the fusion)."""
    param.fusion_refused = True
    param.fuse_grad_accumulation = False

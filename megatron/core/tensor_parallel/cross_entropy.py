"""Cross entropy over logits split along the vocabulary, without gathering them.

Each tensor rank holds logits for its slice of the vocabulary ``[..., V/tp]``. The softmax
normaliser needs the global max and the global sum of exponentials (two all-reduces of
``[...]``-shaped tensors), and the target logit lives on exactly one rank (a third). The full
``[..., V]`` logits never exist on any rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.grad_accumulation import accumulate_matmul_, main_grad_of
from megatron.core.tensor_parallel.mappings import _group, _world


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _softmax(logits: torch.Tensor, target: torch.Tensor, group):
    """The softmax over the whole vocabulary of ``logits`` ``[N, V/tp]`` (contiguous), in
    the softmax dtype: written over ``logits`` when they have it (fp32, fp64), a new fp32
    tensor for half-precision logits. Returns it with the per-row loss ``[N]`` and, for the
    backward, ``local_target`` and ``outside`` (target not in this rank's slice of the
    vocabulary).

    torch's softmax kernel normalises each row in one pass while the row is in cache, where
    separate max/subtract/exp/sum/divide ops would each stream the whole tensor from memory
    (400 MB for 2048 tokens at GPT-2's vocabulary). Half-precision logits are read as they
    are (on CUDA one kernel reads bf16 and writes fp32), never copied to fp32 first. Each
    rank normalises its own slice; the slices are then rescaled to the global sum.
    """
    world = _world(group)
    part = logits.size(-1)
    start = (dist.get_rank(group) if world > 1 else 0) * part
    outside = (target < start) | (target >= start + part)
    local_target = (target - start).masked_fill(outside, 0)

    dtype = _softmax_dtype(logits.dtype)
    local_max, argmax = logits.max(dim=-1)  # [N], one pass over the narrow logits
    local_max = local_max.to(dtype)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(dtype)
    if dtype == logits.dtype:
        softmax = torch.softmax(logits, dim=-1, out=logits)
    else:
        softmax = torch.softmax(logits, dim=-1, dtype=dtype)
    # The probability at the row's largest logit is exp(0) / sum: its log gives log(sum)
    # without the target's probability, which may underflow.
    local_log_sum = softmax.gather(-1, argmax.unsqueeze(-1)).squeeze(-1).log_().neg_()
    logits_max, log_sum = local_max, local_log_sum
    if world > 1:
        logits_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        local_sum = (local_log_sum + local_max - logits_max).exp_()  # sum of exp(x - max)
        sum_exp = _all_reduce(local_sum.clone(), dist.ReduceOp.SUM, group)
        softmax.mul_((local_sum / sum_exp).unsqueeze(-1))
        log_sum = sum_exp.log_()
    target_logit = (target_logit - logits_max).masked_fill_(outside, 0.0)
    target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
    return softmax, log_sum - target_logit, local_target, outside


def _softmax_grad_in_place(softmax: torch.Tensor, local_target: torch.Tensor,
                           outside: torch.Tensor, label_smoothing: float,
                           vocab_size: int) -> torch.Tensor:
    """d loss / d logits ``[N, V/tp]`` for a unit loss gradient: ``softmax - target
    distribution``, written over ``softmax`` (the smoothed case makes a new tensor)."""
    grad = softmax
    if label_smoothing > 0:
        grad = grad - label_smoothing / vocab_size
    hit = (~outside).to(grad.dtype) * (1.0 - label_smoothing)
    grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing):
        # logits: [..., V/tp], target: [...]. The softmax is built in a new buffer (half
        # precision logits are upcast to fp32), so the caller's logits are left intact.
        part = logits.size(-1)
        flat = logits.reshape(-1, part)  # [N, V/tp]
        if _is_wide(logits.dtype):  # the softmax is written over a copy: the caller's
            flat = flat.clone(memory_format=torch.contiguous_format)  # logits stay intact
        softmax, loss, local_target, outside = _softmax(flat.contiguous(), target.reshape(-1),
                                                        group)

        vocab_size = part * _world(group)
        if label_smoothing > 0:
            # Mix in the uniform distribution: loss = (1-a) * nll + a * mean_j(-log p_j).
            log_probs = softmax.clamp_min(1e-30).log()
            mean_log_prob = _all_reduce(log_probs.sum(dim=-1), dist.ReduceOp.SUM, group)
            mean_log_prob = mean_log_prob / vocab_size
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        ctx.save_for_backward(softmax, outside, local_target)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = _softmax_grad_in_place(softmax, local_target, outside, ctx.label_smoothing,
                                      ctx.vocab_size)
        grad.mul_(grad_loss.reshape(-1, 1))
        return grad.view(ctx.logits_shape), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss ``[...]`` from vocab-split logits ``[..., V/tp]`` and ids ``[...]``.

    Equals ``F.cross_entropy(full_logits, target, reduction='none')`` on the gathered logits.
    Half-precision logits are computed on in fp32; the loss is fp32 (or the input's wider
    dtype).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, _group(group), label_smoothing)


class LogitsWorkspace:
    """Keeps the ``[N, V/tp]`` logits buffer of one micro-batch for the next (CPU only).

    glibc hands allocations above 32 MB back to the OS when they are freed, so a fresh
    buffer (400 MB for 2048 tokens at GPT-2's vocabulary) costs about 100K page faults, each
    zeroing a page, on every micro-batch. A buffer is taken in the forward and given back at
    the end of the backward, so micro-batches in flight together never share one.
    """

    def __init__(self, max_buffers: int = 2) -> None:
        self.max_buffers = max_buffers
        self._free: list[torch.Tensor] = []

    def take(self, rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
        for i, buffer in enumerate(self._free):
            if buffer.shape == (rows, cols) and buffer.dtype == dtype and buffer.device == device:
                return self._free.pop(i)
        return torch.empty(rows, cols, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)
        del self._free[:-self.max_buffers]


def _logits_into(hidden: torch.Tensor, weight: torch.Tensor,
                 workspace: Optional[LogitsWorkspace]) -> torch.Tensor:
    """``hidden @ weight.T`` ``[N, V/tp]`` in hidden's dtype; fp32 ones on the CPU go into a
    workspace buffer if there is one (half-precision ones become a new fp32 softmax)."""
    if workspace is None or hidden.device.type != "cpu" or not _is_wide(hidden.dtype):
        return torch.mm(hidden, weight.t())
    logits = workspace.take(hidden.size(0), weight.size(0), hidden.dtype, hidden.device)
    return torch.mm(hidden, weight.t(), out=logits)


def _is_wide(dtype: torch.dtype) -> bool:
    """Whether logits of ``dtype`` are already in the softmax dtype (fp32, fp64)."""
    return _softmax_dtype(dtype) == dtype


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):
    """The LM head and the cross entropy in one: the logits exist only as the buffer that
    becomes the softmax and then the gradient, and no pass over them scales by the loss
    gradient (that scaling is applied to the narrow ``[N, h]`` operands instead). The weight
    gradient is added into ``weight.main_grad`` when the data-parallel wrapper allows it."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, workspace):
        # hidden [N, h], weight [V/tp, h], target [N]
        logits = _logits_into(hidden, weight, workspace)  # [N, V/tp]
        softmax, loss, local_target, outside = _softmax(logits, target, group)
        ctx.save_for_backward(hidden, weight, softmax, local_target, outside)
        ctx.workspace = workspace
        return loss  # [N]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, softmax, local_target, outside = ctx.saved_tensors
        grad = _softmax_grad_in_place(softmax, local_target, outside, 0.0, 0)  # [N, V/tp]
        scale = grad_loss.unsqueeze(-1)  # [N, 1]
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = grad_weight = None
        main_grad = main_grad_of(weight) if need_weight else None
        if grad.dtype == hidden.dtype:
            if need_hidden:
                grad_hidden = grad.mm(weight).mul_(scale)  # [N, h]
            rows = hidden * scale
        else:  # half-precision hidden: the fp32 softmax gradient is scaled and cast in one pass
            grad = torch.mul(grad, scale, out=torch.empty(grad.shape, dtype=hidden.dtype,
                                                          device=grad.device))
            if need_hidden:
                grad_hidden = grad.mm(weight)
            rows = hidden
        if main_grad is not None:
            accumulate_matmul_(main_grad, grad.t(), rows)  # [V/tp, h], no new tensor
        elif need_weight:
            grad_weight = grad.t().mm(rows)  # [V/tp, h]
        if ctx.workspace is not None:
            ctx.workspace.give(softmax)
        return grad_hidden, grad_weight, None, None, None


def linear_vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                        target: torch.Tensor, group=None,
                                        workspace: Optional[LogitsWorkspace] = None
                                        ) -> torch.Tensor:
    """Per-token loss ``[...]`` of ``vocab_parallel_cross_entropy(hidden @ weight.T, target)``
    without keeping the logits apart from the softmax (no label smoothing).

    ``hidden`` ``[..., h]`` (already copied/gathered into the tensor-parallel region),
    ``weight`` ``[V/tp, h]`` (this rank's rows of the output layer), ``target`` ``[...]``.
    ``workspace`` (optional) reuses the logits buffer across calls on CPU.
    """
    shape, h = target.shape, hidden.size(-1)
    hidden, target = hidden.reshape(-1, h), target.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _LinearVocabParallelCrossEntropy.apply(hidden, weight, target, _group(group),
                                                      workspace)
    else:  # no backward will give the buffer back
        logits = _logits_into(hidden, weight, workspace)
        softmax, loss = _softmax(logits, target, _group(group))[:2]
        if workspace is not None and hidden.device.type == "cpu":
            workspace.give(softmax)
    return loss.view(shape)

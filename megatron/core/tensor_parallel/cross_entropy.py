"""Cross entropy over logits split along the vocabulary, without gathering them.

Each tensor rank holds logits for its slice of the vocabulary ``[..., V/tp]``. The softmax
normaliser needs the global max and the global sum of exponentials (two all-reduces of
``[...]``-shaped tensors), and the target logit lives on exactly one rank (a third). The full
``[..., V]`` logits never exist on any rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import _group, _world


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing):
        # logits: [..., V/tp], target: [...]; half-precision logits are upcast to fp32.
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        world = _world(group)
        rank = dist.get_rank(group) if world > 1 else 0
        part = logits.size(-1)
        start = rank * part

        logits_max = _all_reduce(logits.max(dim=-1)[0], dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)  # [..., V/tp]

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(target_logit.masked_fill(outside, 0.0), dist.ReduceOp.SUM,
                                   group)

        exp = shifted.exp_()  # reuse the buffer: [..., V/tp]
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - target_logit  # [...]
        softmax = exp.div_(sum_exp.unsqueeze(-1))

        vocab_size = part * world
        if label_smoothing > 0:
            # Mix in the uniform distribution: loss = (1-a) * nll + a * mean_j(-log p_j).
            log_probs = softmax.clamp_min(1e-30).log()
            mean_log_prob = _all_reduce(log_probs.sum(dim=-1), dist.ReduceOp.SUM, group)
            mean_log_prob = mean_log_prob / vocab_size
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        ctx.save_for_backward(softmax, outside, local_target)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target), computed in place
        one_hot_weight = 1.0 - ctx.label_smoothing
        if ctx.label_smoothing > 0:
            grad = grad - ctx.label_smoothing / ctx.vocab_size
        hit = (~outside).to(grad.dtype) * one_hot_weight
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss ``[...]`` from vocab-split logits ``[..., V/tp]`` and ids ``[...]``.

    Equals ``F.cross_entropy(full_logits, target, reduction='none')`` on the gathered logits.
    Half-precision logits are computed on in fp32; the loss is fp32 (or the input's wider
    dtype).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, _group(group), label_smoothing)

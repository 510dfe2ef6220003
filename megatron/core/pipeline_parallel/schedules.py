"""Forward/backward schedules over the micro-batches of one iteration.

Every schedule has one signature::

    schedule(*, forward_step_func, data_iterator, model, num_microbatches,
             seq_length, micro_batch_size, forward_only=False, grad_scale_func=None)
        -> list of per-micro-batch loss dicts (on the last pipeline stage; [] elsewhere)

``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`` runs one
micro-batch; ``loss_func(output_tensor) -> (loss, {"lm loss": reported_value})``. The loss of
each micro-batch is divided by the number of micro-batches, so the accumulated gradient is the
mean over the global batch. Gradient reduction across ranks is left to the caller
(``finalize_model_grads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from megatron.core import parallel_state

LossDict = dict[str, torch.Tensor]


def _as_list(model: Union[nn.Module, Sequence[nn.Module]]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def forward_step(forward_step_func: Callable, data_iterator: Iterator, model: nn.Module,
                 num_microbatches: int, losses: list[LossDict]) -> torch.Tensor:
    """One micro-batch forward. On the last stage returns the scaled loss and records the
    reported values; elsewhere returns the activation for the next stage."""
    output, loss_func = forward_step_func(data_iterator, model)
    if not parallel_state.is_pipeline_last_stage():
        return output
    loss, reported = loss_func(output)
    losses.append(reported)
    return loss / num_microbatches


def _no_sync(model: nn.Module):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator,
                                   model: Union[nn.Module, Sequence[nn.Module]],
                                   num_microbatches: int, seq_length: int = 0,
                                   micro_batch_size: int = 0, forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   **_unused: Any) -> list[LossDict]:
    """Run all micro-batches on one stage; data-parallel gradient sync only on the last."""
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError("the non-pipelined schedule takes one model chunk")
    model = chunks[0]
    losses: list[LossDict] = []
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with context:
        for i in range(num_microbatches):
            last = i == num_microbatches - 1
            sync = contextlib.nullcontext() if last or forward_only else _no_sync(model)
            with sync:
                loss = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                    losses)
                if not forward_only:
                    if grad_scale_func is not None:
                        loss = grad_scale_func(loss)
                    loss.backward()
    return losses


def get_forward_backward_func() -> Callable[..., list[LossDict]]:
    """The schedule for this rank's pipeline layout."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("pipeline-parallel schedules are not implemented yet")
    return forward_backward_no_pipelining

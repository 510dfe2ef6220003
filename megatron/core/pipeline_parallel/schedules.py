"""Forward/backward schedules over the micro-batches of one iteration.

Every schedule has one signature::

    schedule(*, forward_step_func, data_iterator, model, num_microbatches,
             seq_length, micro_batch_size, forward_only=False, grad_scale_func=None,
             timers=None)
        -> list of per-micro-batch loss dicts (on the last pipeline stage; [] elsewhere)

``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`` runs one
micro-batch; ``loss_func(output_tensor) -> (loss, {"lm loss": reported_value})``. The loss of
each micro-batch is divided by the number of micro-batches, so the accumulated gradient is the
mean over the global batch. Gradient reduction across ranks is left to the caller
(``finalize_model_grads``).

Three schedules (``get_forward_backward_func`` picks one from the parallel layout):

- no pipelining: all micro-batches on one stage;
- 1F1B (PipeDream-Flush): stage i of p runs ``p - i - 1`` warm-up forwards, then alternates
  one forward and one backward, then drains the remaining backwards (cool-down). At most
  ``p - i`` micro-batches hold activations at once;
- interleaved 1F1B: each stage holds v model chunks (virtual stages; chunk c of stage i is
  model part ``c * p + i``), micro-batches go round the ring of stages v times, and the bubble
  shrinks v-fold. Needs the number of micro-batches to be a multiple of p.

Under pipelining, ``model`` may be one chunk or a list (one per virtual stage); each chunk
must have ``set_input_tensor`` (the data-parallel wrapper passes it through) and a ``config``
with ``hidden_size``, ``params_dtype``, ``sequence_parallel`` and
``tensor_model_parallel_size`` (ModelConfig), from which the shape passed between stages is
derived; ``tensor_shape``/``dtype`` override it, and ``communicator`` replaces the
point-to-point layer (tests pass a recording one).

The schedule tells ``forward_step_func`` where it runs: a callback that takes a ``stage``
argument, ``forward_step_func(data_iterator, model, stage)``, receives a ``StageInfo`` (first
and last stage of the whole pipeline, virtual chunk index); Megatron's two-argument form
``forward_step_func(data_iterator, model)`` keeps working. No global stage state is written.

Once a stage's output activation has been sent to the next stage, only its autograd graph is
needed for the backward, not its values: the schedules free its data
(``deallocate_output_tensor``, as Megatron does) and run that backward through the autograd
engine directly (``custom_backward``), which skips the check that the gradient has the
output's current shape. This saves one ``[s, b, h]`` activation per micro-batch in flight.

With ``timers`` (megatron.core.timers.Timers), the pipelined schedules add up this rank's time in
``forward-compute``, ``backward-compute`` and ``pipeline-wait`` (in point-to-point exchanges:
waiting for a neighbour, i.e. the bubble, plus the transfer itself).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, activation_shape

LossDict = dict[str, torch.Tensor]

FORWARD_TIMER = "forward-compute"
BACKWARD_TIMER = "backward-compute"
WAIT_TIMER = "pipeline-wait"


def _as_list(model: Union[nn.Module, Sequence[nn.Module]]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


@dataclass(frozen=True)
class StageInfo:
    """Where one forward step runs: ``is_first`` reads the tokens (first virtual stage of the
    whole pipeline), ``is_last`` computes the loss, ``chunk`` is the virtual chunk on this
    rank (0 without interleaving)."""

    is_first: bool = True
    is_last: bool = True
    chunk: int = 0


def takes_stage(forward_step_func: Callable) -> bool:
    """Whether the callback accepts the ``stage`` argument."""
    try:
        return "stage" in inspect.signature(forward_step_func).parameters
    except (TypeError, ValueError):
        return False


def forward_step(forward_step_func: Callable, data_iterator: Iterator, model: nn.Module,
                 num_microbatches: int, losses: list[LossDict], *,
                 input_tensor: Optional[torch.Tensor] = None,
                 stage: StageInfo = StageInfo()) -> torch.Tensor:
    """One micro-batch forward. On the last stage returns the scaled loss and records the
    reported values; elsewhere returns the activation for the next stage.

    ``input_tensor`` (the previous stage's activation) is handed to the model through
    ``set_input_tensor`` when the model has it; ``stage`` says where this step runs and is
    passed on to callbacks that take it.
    """
    set_input = getattr(model, "set_input_tensor", None)
    if callable(set_input):
        set_input(input_tensor)
    if takes_stage(forward_step_func):
        output, loss_func = forward_step_func(data_iterator, model, stage=stage)
    else:
        output, loss_func = forward_step_func(data_iterator, model)
    if not stage.is_last:
        return output
    loss, reported = loss_func(output)
    losses.append(reported)
    return loss / num_microbatches


def deallocate_output_tensor(output: Optional[torch.Tensor]) -> None:
    """Replace the data of a sent output activation by one element; its graph stays.

    Views are left alone (their storage belongs to another tensor), as are tensors outside
    any graph.
    """
    if output is None or output._base is not None or output.grad_fn is None:
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``torch.autograd.backward(output, grad_output)`` for an ``output`` whose data may have
    been freed by ``deallocate_output_tensor``: the engine is called directly, so only the
    shape recorded in the graph must match ``grad_output``."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


def backward_step(input_tensor: Optional[torch.Tensor], output_tensor: torch.Tensor,
                  output_tensor_grad: Optional[torch.Tensor],
                  grad_scale_func: Optional[Callable] = None) -> Optional[torch.Tensor]:
    """Backward through one stage for one micro-batch; returns the gradient of its input.

    On the last stage ``output_tensor`` is the loss (scaled by ``grad_scale_func`` for fp16)
    and ``output_tensor_grad`` is None; elsewhere it is the activation that was sent on and
    ``output_tensor_grad`` the gradient the next stage sent back.
    """
    if output_tensor_grad is None:
        if grad_scale_func is not None:
            output_tensor = grad_scale_func(output_tensor)
        output_tensor.backward()
    else:
        custom_backward(output_tensor, output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


def _no_sync(model: nn.Module):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


# No pipelining -------------------------------------------------------------------------------


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


# Shared machinery of the pipelined schedules --------------------------------------------------


class _PhaseTimers:
    """``with phases(FORWARD_TIMER): ...`` adds the block's time to that timer, if any."""

    def __init__(self, timers: Optional[Any]) -> None:
        self.timers = timers

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.timers is None:
            yield
            return
        timer = self.timers(name, log_level=1)
        timer.start()
        try:
            yield
        finally:
            timer.stop()


class _GradSync:
    """Keeps each chunk inside its data-parallel ``no_sync`` until that chunk's last backward
    of the iteration, so gradient reduction (with --overlap-grad-reduce) starts only then."""

    def __init__(self, chunks: Sequence[nn.Module], num_microbatches: int,
                 enabled: bool) -> None:
        self.remaining = [num_microbatches] * len(chunks)
        self.stacks = [contextlib.ExitStack() for _ in chunks]
        if enabled:
            for stack, chunk in zip(self.stacks, chunks):
                stack.enter_context(_no_sync(chunk))

    def before_backward(self, chunk_id: int) -> None:
        self.remaining[chunk_id] -= 1
        if self.remaining[chunk_id] == 0:
            self.stacks[chunk_id].close()

    def close(self) -> None:
        for stack in self.stacks:
            stack.close()


def _model_config(chunk: nn.Module) -> Any:
    config = getattr(chunk, "config", None)
    if config is None:
        raise ValueError("pipeline schedules need model.config (hidden_size, params_dtype, "
                         "...) or explicit tensor_shape= and dtype=")
    return config


def build_communicator(chunk: nn.Module, seq_length: int, micro_batch_size: int, *,
                       tensor_shape: Optional[Sequence[int]] = None,
                       dtype: Optional[torch.dtype] = None) -> P2PCommunicator:
    """The point-to-point layer for this model: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
    parallelism) in the model's params dtype, on the device of its parameters."""
    if tensor_shape is None or dtype is None:
        config = _model_config(chunk)
        if tensor_shape is None:
            # Under context parallelism each rank passes on its share of the sequence.
            seq_length //= getattr(config, "context_parallel_size", 1)
            tensor_shape = activation_shape(
                seq_length, micro_batch_size, config.hidden_size,
                sequence_parallel=getattr(config, "sequence_parallel", False),
                tensor_model_parallel_size=getattr(config, "tensor_model_parallel_size", 1))
        if dtype is None:
            dtype = config.params_dtype
    param = next(chunk.parameters(), None)
    device = param.device if param is not None else parallel_state.get_default_device()
    return P2PCommunicator(tensor_shape, dtype, device)


class _Stage:
    """What one pipelined schedule run needs besides its loop: the chunks, their data, the
    communicator, the timers, the losses and the gradient-sync control."""

    def __init__(self, *, forward_step_func: Callable, data_iterator: Any,
                 chunks: list[nn.Module], num_microbatches: int, forward_only: bool,
                 grad_scale_func: Optional[Callable], comm: P2PCommunicator,
                 timers: Optional[Any]) -> None:
        self.forward_step_func = forward_step_func
        self.chunks = chunks
        if isinstance(data_iterator, (list, tuple)):
            self.data = list(data_iterator)  # one iterator per chunk (Megatron's convention)
        else:
            self.data = [data_iterator] * len(chunks)
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.grad_scale_func = grad_scale_func
        self.comm = comm
        self.phase = _PhaseTimers(timers)
        self.losses: list[LossDict] = []
        self.grad_sync = _GradSync(chunks, num_microbatches, not forward_only)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def is_first(self, chunk_id: int) -> bool:
        """The first virtual stage of the whole pipeline: reads tokens, has no input."""
        return self.comm.is_first_stage and chunk_id == 0

    def is_last(self, chunk_id: int) -> bool:
        """The last virtual stage of the whole pipeline: computes the loss."""
        return self.comm.is_last_stage and chunk_id == self.num_chunks - 1

    def stage_info(self, chunk_id: int) -> StageInfo:
        return StageInfo(self.is_first(chunk_id), self.is_last(chunk_id), chunk_id)

    def forward(self, chunk_id: int, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        with self.phase(FORWARD_TIMER):
            return forward_step(self.forward_step_func, self.data[chunk_id],
                                self.chunks[chunk_id], self.num_microbatches, self.losses,
                                input_tensor=input_tensor, stage=self.stage_info(chunk_id))

    def backward(self, chunk_id: int, input_tensor: Optional[torch.Tensor],
                 output_tensor: torch.Tensor,
                 output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        self.grad_sync.before_backward(chunk_id)
        with self.phase(BACKWARD_TIMER):
            return backward_step(input_tensor, output_tensor, output_grad,
                                 self.grad_scale_func)

    def exchange(self, **kwargs: Any) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        with self.phase(WAIT_TIMER):
            received = self.comm.exchange(**kwargs)
        if not self.forward_only:  # the send has completed: keep only the graph
            deallocate_output_tensor(kwargs.get("send_next"))
        return received

    def finish(self) -> list[LossDict]:
        self.grad_sync.close()
        return self.losses


def _build_stage(forward_step_func: Callable, data_iterator: Any, model: Any,
                 num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool, grad_scale_func: Optional[Callable], timers: Optional[Any],
                 communicator: Optional[P2PCommunicator], tensor_shape, dtype) -> _Stage:
    chunks = _as_list(model)
    if num_microbatches < 1:
        raise ValueError(f"a pipelined iteration needs at least one micro-batch, got "
                         f"{num_microbatches}")
    comm = communicator or build_communicator(chunks[0], seq_length, micro_batch_size,
                                              tensor_shape=tensor_shape, dtype=dtype)
    return _Stage(forward_step_func=forward_step_func, data_iterator=data_iterator,
                  chunks=chunks, num_microbatches=num_microbatches, forward_only=forward_only,
                  grad_scale_func=grad_scale_func, comm=comm, timers=timers)


# 1F1B without interleaving -------------------------------------------------------------------


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator: Any,
        model: Union[nn.Module, Sequence[nn.Module]], num_microbatches: int,
        seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
        grad_scale_func: Optional[Callable] = None, timers: Optional[Any] = None,
        communicator: Optional[P2PCommunicator] = None,
        tensor_shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None,
        **_unused: Any) -> list[LossDict]:
    """1F1B over one model chunk per stage (see the module docstring)."""
    if len(_as_list(model)) != 1:
        raise ValueError("the non-interleaved pipeline schedule takes one model chunk per "
                         f"stage, got {len(_as_list(model))}")
    stage = _build_stage(forward_step_func, data_iterator, model, num_microbatches,
                         seq_length, micro_batch_size, forward_only, grad_scale_func, timers,
                         communicator, tensor_shape, dtype)
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with context:
        if forward_only:
            _forward_all(stage)
        else:
            _one_forward_one_backward(stage)
    return stage.finish()


def _forward_all(stage: _Stage) -> None:
    """Evaluation: receive, forward and send on every micro-batch; nothing is kept."""
    for _ in range(stage.num_microbatches):
        x = stage.exchange(recv_prev=not stage.comm.is_first_stage)[0]
        y = stage.forward(0, x)
        stage.exchange(send_next=None if stage.comm.is_last_stage else y)


def _one_forward_one_backward(stage: _Stage) -> None:
    comm, m = stage.comm, stage.num_microbatches
    first, last = comm.is_first_stage, comm.is_last_stage
    warmup = min(comm.num_stages - comm.stage - 1, m)
    steady = m - warmup
    in_flight: deque = deque()  # (input, output) of micro-batches awaiting their backward

    # Warm-up: forwards only, filling the pipeline below this stage.
    for _ in range(warmup):
        x = stage.exchange(recv_prev=not first)[0]
        y = stage.forward(0, x)
        stage.exchange(send_next=None if last else y)
        in_flight.append((x, y))

    # Steady state: each forward's output goes on while the gradient of the oldest
    # micro-batch in flight comes back, and that micro-batch's input gradient goes back while
    # the next input arrives.
    x = stage.exchange(recv_prev=not first)[0] if steady > 0 else None
    for i in range(steady):
        final = i == steady - 1
        y = stage.forward(0, x)
        dy = stage.exchange(send_next=None if last else y, recv_next=not last)[1]
        in_flight.append((x, y))
        x_old, y_old = in_flight.popleft()
        dx = stage.backward(0, x_old, y_old, dy)
        send = None if first else dx
        x = stage.exchange(send_prev=send, recv_prev=not first and not final)[0]

    # Cool-down: the backwards of the warm-up micro-batches.
    for _ in range(warmup):
        dy = stage.exchange(recv_next=not last)[1]
        x_old, y_old = in_flight.popleft()
        dx = stage.backward(0, x_old, y_old, dy)
        stage.exchange(send_prev=None if first else dx)


# Interleaved 1F1B ----------------------------------------------------------------------------


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int) -> None:
    """The interleaved schedule sends micro-batches round the stages in groups of p."""
    if num_microbatches % pipeline_size != 0:
        raise ValueError(
            f"the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage) "
            f"needs the number of micro-batches per iteration ({num_microbatches}) to be a "
            f"multiple of --pipeline-model-parallel-size ({pipeline_size}); micro-batches = "
            "--global-batch-size / (--micro-batch-size x data-parallel size)")


class _Interleaving:
    """Virtual micro-batch k (0 <= k < m * v) of a stage: which chunk runs it.

    Forwards go through the chunks in groups of p micro-batches: k = 0..p-1 on chunk 0,
    p..2p-1 on chunk 1, ..., then the next p micro-batches on chunk 0 again. Backwards visit
    the chunks in the reverse order.
    """

    def __init__(self, pipeline_size: int, num_chunks: int, num_microbatches: int) -> None:
        self.p, self.v, self.m = pipeline_size, num_chunks, num_microbatches
        self.total = num_microbatches * num_chunks

    def chunk(self, k: int, forward: bool) -> int:
        # Python's modulo also maps a negative k (before the start) into the pattern, which
        # the steady-state look-back relies on.
        c = (k % (self.p * self.v)) // self.p
        return c if forward else self.v - 1 - c

    def warmup(self, stage: int, forward_only: bool) -> int:
        """Forwards before the first backward on ``stage``."""
        if forward_only or self.m == self.p:
            return self.total  # with m == p there is no steady state (all forward, then back)
        return min(self.total, 2 * (self.p - stage - 1) + (self.v - 1) * self.p)


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator: Any, model: Sequence[nn.Module],
        num_microbatches: int, seq_length: int = 0, micro_batch_size: int = 0,
        forward_only: bool = False, grad_scale_func: Optional[Callable] = None,
        timers: Optional[Any] = None, communicator: Optional[P2PCommunicator] = None,
        tensor_shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None,
        **_unused: Any) -> list[LossDict]:
    """Interleaved 1F1B over this stage's virtual chunks (see the module docstring)."""
    stage = _build_stage(forward_step_func, data_iterator, model, num_microbatches,
                         seq_length, micro_batch_size, forward_only, grad_scale_func, timers,
                         communicator, tensor_shape, dtype)
    check_interleaved_microbatches(num_microbatches, stage.comm.num_stages)
    run = _InterleavedRun(stage)
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with context:
        run.warmup()
        run.steady()
        run.cooldown()
    return stage.finish()


class _InterleavedRun:
    """The three phases of the interleaved schedule on one stage, with per-chunk queues."""

    def __init__(self, stage: _Stage) -> None:
        self.stage, comm = stage, stage.comm
        self.plan = _Interleaving(comm.num_stages, stage.num_chunks, stage.num_microbatches)
        self.num_warmup = self.plan.warmup(comm.stage, stage.forward_only)
        self.num_steady = self.plan.total - self.num_warmup
        v = stage.num_chunks
        self.inputs: list[deque] = [deque() for _ in range(v)]  # received, not yet run
        self.grads: list[deque] = [deque() for _ in range(v)]  # received output gradients
        self.in_flight: list[deque] = [deque() for _ in range(v)]  # (input, output) to backward

    # One forward / one backward of virtual micro-batch k --------------------------------

    def forward(self, k: int) -> Optional[torch.Tensor]:
        """Runs virtual micro-batch k forward; returns what goes to the next stage (or None)."""
        c = self.plan.chunk(k, forward=True)
        x = None if self.stage.is_first(c) else self.inputs[c].popleft()
        y = self.stage.forward(c, x)
        if not self.stage.forward_only:
            self.in_flight[c].append((x, y))
        return None if self.stage.is_last(c) else y

    def backward(self, k: int) -> Optional[torch.Tensor]:
        """Runs virtual micro-batch k backward; returns what goes to the previous stage."""
        c = self.plan.chunk(k, forward=False)
        dy = None if self.stage.is_last(c) else self.grads[c].popleft()
        x, y = self.in_flight[c].popleft()
        dx = self.stage.backward(c, x, y, dy)
        return None if self.stage.is_first(c) else dx

    def _receive(self, x, dy, input_chunk: Optional[int], grad_chunk: Optional[int]) -> None:
        if input_chunk is not None:
            self.inputs[input_chunk].append(x)
        if grad_chunk is not None:
            self.grads[grad_chunk].append(dy)

    # Phases -----------------------------------------------------------------------------

    def warmup(self) -> None:
        stage, plan, comm = self.stage, self.plan, self.stage.comm
        if not comm.is_first_stage:
            self.inputs[0].append(stage.exchange(recv_prev=True)[0])
        for k in range(self.num_warmup):
            y = self.forward(k)
            next_chunk = plan.chunk(k + 1, forward=True)
            # The next input comes from the previous stage unless it is data (first chunk of
            # the first stage) or there is none.
            recv_prev = not (comm.is_first_stage and next_chunk == 0) and k < plan.total - 1
            # The last warm-up step also fetches the gradient for the first backward.
            first_grad = (k == self.num_warmup - 1 and self.num_steady > 0
                          and not comm.is_last_stage)
            x, dy = stage.exchange(send_next=y, recv_prev=recv_prev, recv_next=first_grad)
            self._receive(x, dy, next_chunk if recv_prev else None,
                          plan.v - 1 if first_grad else None)

    def steady(self) -> None:
        stage, plan, comm = self.stage, self.plan, self.stage.comm
        p, v = plan.p, plan.v
        for i in range(self.num_steady):
            k_fwd, k_bwd = self.num_warmup + i, i
            y = self.forward(k_fwd)
            dx = self.backward(k_bwd)
            # What arrives now was produced by the neighbour in this same step. The first
            # stage receives from the last, which is p - 1 virtual micro-batches behind:
            # nothing if that one ran the last chunk (it made a loss, not an activation).
            if comm.is_first_stage:
                sender_chunk = plan.chunk(k_fwd - (p - 1), forward=True)
                recv_prev, input_chunk = sender_chunk != v - 1, sender_chunk + 1
            else:
                recv_prev, input_chunk = True, plan.chunk(k_fwd + 1, forward=True)
            # Symmetrically the last stage gets gradients from the first, p - 1 behind.
            if comm.is_last_stage:
                sender_chunk = plan.chunk(k_bwd - (p - 1), forward=False)
                recv_next, grad_chunk = sender_chunk != 0, sender_chunk - 1
            else:
                recv_next, grad_chunk = True, plan.chunk(k_bwd + 1, forward=False)
            if i == self.num_steady - 1:
                recv_prev = False  # no forwards left
            x, dy = stage.exchange(send_next=y, send_prev=dx, recv_prev=recv_prev,
                                   recv_next=recv_next)
            self._receive(x, dy, input_chunk if recv_prev else None,
                          grad_chunk if recv_next else None)

    def cooldown(self) -> None:
        stage, plan, comm = self.stage, self.plan, self.stage.comm
        if stage.forward_only:
            return
        if self.num_steady == 0 and not comm.is_last_stage:
            self.grads[plan.v - 1].append(stage.exchange(recv_next=True)[1])
        for k in range(self.num_steady, plan.total):
            dx = self.backward(k)
            next_chunk = plan.chunk(k + 1, forward=False)
            recv_next = (not (comm.is_last_stage and next_chunk == plan.v - 1)
                         and k < plan.total - 1)
            _, dy = stage.exchange(send_prev=dx, recv_next=recv_next)
            self._receive(None, dy, None, next_chunk if recv_next else None)


# Choice ---------------------------------------------------------------------------------------


def get_forward_backward_func() -> Callable[..., list[LossDict]]:
    """The schedule for this rank's pipeline layout."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp is not None and vp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

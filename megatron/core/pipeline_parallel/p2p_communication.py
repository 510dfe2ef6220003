"""Point-to-point communication between neighbouring pipeline stages.

Stage i sends activations forward to stage i + 1 and receives their gradients back from it.
Every micro-batch has the same shape, known before the first one runs (``[s, b, h]``, or
``[s/tp, b, h]`` under sequence parallelism, in the model's params dtype), so a receiver
allocates its buffer without a shape handshake.

One ``exchange`` call posts all of a stage's sends and receives for one step of a schedule at
once and waits for all of them:

- batched (default): ``torch.distributed.batch_isend_irecv``, which NCCL runs as one group
  (so a send and a receive between the same two ranks cannot block each other) and gloo as
  independent non-blocking operations;
- unbatched (``batched=False``): plain ``isend``/``irecv`` posted in an order that alternates
  with the stage's parity (even stages send first, odd stages receive first), Megatron's
  order for backends without grouped point-to-point.

Why the schedules cannot deadlock: every send a schedule posts is matched by the receive the
neighbour posts in the same position of its own sequence of exchanges, and both sides post
them inside one exchange before waiting (see ``schedules``; ``tests/unit/
test_pipeline_schedules.py`` checks this for many layouts with a rendezvous model in which a
send completes only when its receive is posted).

Messages carry a tag per direction (activations forward, gradients backward). With two stages
and interleaving the previous and the next rank are the same process; the tags keep the two
streams apart on gloo, and the fixed order in which ``exchange`` posts the operations (forward
direction first) keeps them apart where tags are ignored (NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, timeouts

FORWARD_TAG = 1  # activations: stage i -> i + 1
BACKWARD_TAG = 2  # gradients: stage i + 1 -> i


def activation_shape(seq_length: int, micro_batch_size: int, hidden_size: int, *,
                     sequence_parallel: bool = False,
                     tensor_model_parallel_size: int = 1) -> tuple[int, int, int]:
    """The ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) passed between stages."""
    if sequence_parallel and tensor_model_parallel_size > 1:
        if seq_length % tensor_model_parallel_size != 0:
            raise ValueError(
                f"--seq-length ({seq_length}) is not divisible by --tensor-model-parallel-size "
                f"({tensor_model_parallel_size}) under --sequence-parallel")
        seq_length //= tensor_model_parallel_size
    return (seq_length, micro_batch_size, hidden_size)


_WARM_GROUPS: set = set()  # pipeline groups whose NCCL communicator exists (see below)


def _warm_up_nccl(group: Any, device: torch.device) -> None:
    """Under NCCL, run one collective on ``group`` before its first batched point-to-point.

    torch.distributed.batch_isend_irecv requires every rank of the group to take part in the
    group's first NCCL call, and a pipeline schedule's first exchanges involve only some
    stages. Every stage builds its communicator at the start of the same schedule call, so
    this all-reduce is matched; it runs once per group.
    """
    if dist.get_backend(group) != "nccl" or group in _WARM_GROUPS:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _WARM_GROUPS.add(group)


class P2PCommunicator:
    """Sends and receives fixed-shape tensors to and from the neighbouring pipeline stages.

    Ranks are global ranks (what ``torch.distributed`` point-to-point takes); the previous
    rank of the first stage is the last stage and the next rank of the last stage is the first
    (the interleaved schedule passes activations around that ring).
    """

    def __init__(self, tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device, *, group: Any = None,
                 prev_rank: Optional[int] = None, next_rank: Optional[int] = None,
                 batched: bool = True) -> None:
        self.tensor_shape = tuple(int(n) for n in tensor_shape)
        self.dtype, self.device = dtype, torch.device(device)
        self.group = parallel_state.get_pipeline_model_parallel_group() if group is None else group
        self.prev_rank = (parallel_state.get_pipeline_model_parallel_prev_rank()
                          if prev_rank is None else prev_rank)
        self.next_rank = (parallel_state.get_pipeline_model_parallel_next_rank()
                          if next_rank is None else next_rank)
        self.stage = dist.get_rank(self.group)
        self.num_stages = dist.get_world_size(self.group)
        self.batched = batched
        # gloo has no point-to-point for CUDA tensors: such exchanges go through host memory
        # (several ranks on one GPU, as tests run them; NCCL is the backend for real runs).
        self.via_host = self.device.type == "cuda" and dist.get_backend(self.group) == "gloo"
        _warm_up_nccl(self.group, self.device)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    # The one primitive -------------------------------------------------------------------

    def exchange(self, *, send_next: Optional[torch.Tensor] = None,
                 send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
                 recv_next: bool = False) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Post the given sends and receives together and wait for all of them.

        Returns ``(from_prev, from_next)``: the activation received from the previous stage
        (a leaf that requires grad, so backward yields its gradient) and the gradient received
        from the next stage; None where nothing was asked.
        """
        for name, tensor in (("send_next", send_next), ("send_prev", send_prev)):
            if tensor is not None:
                self._check(name, tensor)
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        # Forward direction first (see the module docstring: the order matters where the
        # previous and the next rank are one process and tags are ignored).
        ops = []
        if send_next is not None:
            ops.append((dist.isend, self._outgoing(send_next), self.next_rank, FORWARD_TAG))
        if from_prev is not None:
            ops.append((dist.irecv, from_prev, self.prev_rank, FORWARD_TAG))
        if send_prev is not None:
            ops.append((dist.isend, self._outgoing(send_prev), self.prev_rank, BACKWARD_TAG))
        if from_next is not None:
            ops.append((dist.irecv, from_next, self.next_rank, BACKWARD_TAG))
        if ops:
            self._run(ops)
        if from_prev is not None:  # a leaf that requires grad: backward yields its gradient
            from_prev = self._incoming(from_prev).requires_grad_(True)
        if from_next is not None:
            from_next = self._incoming(from_next)
        return from_prev, from_next

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().cpu() if self.via_host else tensor.contiguous()

    def _incoming(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device) if self.via_host else tensor

    def _run(self, ops: list) -> None:
        if self.batched:
            requests = dist.batch_isend_irecv([
                dist.P2POp(op, tensor, peer, group=self.group, tag=tag)
                for op, tensor, peer, tag in ops])
        else:
            # Even stages send first, odd stages receive first: each blocking pair of a naive
            # backend then meets a partner posted in the opposite order.
            sends_first = self.stage % 2 == 0
            ops = sorted(ops, key=lambda o: (o[0] is dist.isend) != sends_first)
            requests = [op(tensor, peer, group=self.group, tag=tag)
                        for op, tensor, peer, tag in ops]
        for i, request in enumerate(requests):
            try:
                request.wait()
            except RuntimeError as error:
                if not timeouts.is_timeout(error):
                    raise
                # NCCL may hand back one request for the whole batch.
                waited = [ops[i]] if len(requests) == len(ops) else ops
                raise timeouts.PointToPointTimeout(self._pending(waited), error) from error

    def _pending(self, ops: list) -> timeouts.Pending:
        """The transfers ``ops`` as a timed-out operation, for the one-line report."""
        words = [f"{'send' if op is dist.isend else 'recv'} of "
                 f"{'activations' if tag == FORWARD_TAG else 'gradients'} "
                 f"{'to' if op is dist.isend else 'from'} rank {peer}"
                 for op, _, peer, tag in ops]
        return timeouts.Pending(self.group.group_name, self.group.group_desc, " and ".join(words),
                                -1, tuple(sorted({peer for _, _, peer, _ in ops})))

    def _empty(self) -> torch.Tensor:
        device = torch.device("cpu") if self.via_host else self.device
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=device)

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline stage {self.stage}: {name} got a tensor of shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype}, but stages exchange "
                f"{self.tensor_shape} in {self.dtype} ([s, b, h] from --seq-length, "
                "--micro-batch-size and --hidden-size, in the params dtype)")

    # Named steps of the non-interleaved schedule -----------------------------------------
    # Each is a no-op (returning None) where the stage has no neighbour in that direction.

    def recv_forward(self) -> Optional[torch.Tensor]:
        """The activation from the previous stage (None on the first stage)."""
        if self.is_first_stage:
            return None
        return self.exchange(recv_prev=True)[0]

    def recv_backward(self) -> Optional[torch.Tensor]:
        """The gradient of this stage's output from the next stage (None on the last)."""
        if self.is_last_stage:
            return None
        return self.exchange(recv_next=True)[1]

    def send_forward(self, output: Optional[torch.Tensor]) -> None:
        if not self.is_last_stage:
            self.exchange(send_next=output)

    def send_backward(self, input_grad: Optional[torch.Tensor]) -> None:
        if not self.is_first_stage:
            self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Send this micro-batch's output on; receive the gradient of an earlier output."""
        if self.is_last_stage:
            return None
        return self.exchange(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Send an input gradient back; receive the next micro-batch's input."""
        if self.is_first_stage:
            return None
        return self.exchange(send_prev=input_grad, recv_prev=True)[0]

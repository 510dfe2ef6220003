"""Random state for tensor parallelism, and activation checkpointing that replays it.

Dropout *outside* tensor-parallel regions (on replicated activations) must draw the same mask
on every tensor rank; *inside* (on a rank's own heads) the masks must differ. The default
generator is seeded identically across a tensor-parallel group for the former; the tracker
holds a second, per-tensor-rank state for the latter and swaps it in with ``fork()``.

The tracker works on the device that computes (CUDA generator on GPU, CPU generator otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron.core import parallel_state

_MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset that separates the per-tensor-rank stream from the default one (Megatron's value).
_TENSOR_PARALLEL_SEED_OFFSET = 2718


def _device_type() -> str:
    return parallel_state.get_default_device().type


def _get_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that can be swapped in for a block of code."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device_type = "cpu"

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def fits(self, states: dict[str, torch.Tensor]) -> bool:
        """Whether ``states`` were taken from generators of this tracker's device type (a
        CPU generator's state and a CUDA one's differ in size), e.g. from a checkpoint."""
        size = _get_rng_state(self.device_type).numel()
        return all(state.numel() == size for state in states.values())

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.device_type = _device_type()
        saved = _get_rng_state(self.device_type)
        _manual_seed(seed, self.device_type)
        self.states[name] = _get_rng_state(self.device_type)
        _set_rng_state(saved, self.device_type)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        """Run the block with the named state; keep its advance; restore the default after."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added (call model_parallel_seed)")
        saved = _get_rng_state(self.device_type)
        _set_rng_state(self.states[name], self.device_type)
        try:
            yield
        finally:
            self.states[name] = _get_rng_state(self.device_type)
            _set_rng_state(saved, self.device_type)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed the default generator (same on all tensor ranks of a pipeline stage) and the
    tracker's tensor-parallel stream (different per tensor rank)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    device_type = _device_type()
    default_seed = seed + 100 * pp_rank
    torch.manual_seed(default_seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(default_seed)
    _TRACKER.reset()
    _TRACKER.add(_MODEL_PARALLEL_RNG, default_seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)


def _capture_rng() -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda_state, _TRACKER.get_states()


def _restore_rng(cpu_state, cuda_state, tracker_states) -> None:
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    _TRACKER.set_states(tracker_states)


def _capture_autocast() -> list[tuple[str, torch.dtype]]:
    """The autocast contexts active now, so a recomputation runs in the same precision."""
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def _replay_autocast(active: list[tuple[str, torch.dtype]]):
    with contextlib.ExitStack() as stack:
        for device_type, dtype in active:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


class _CheckpointFunction(torch.autograd.Function):
    """Run ``fn`` without saving activations; in backward, restore every RNG state that the
    forward saw (default CPU/CUDA generators and the tracker) and run it again."""

    @staticmethod
    def forward(ctx, fn, num_tensor_args, *args):
        ctx.fn = fn
        ctx.rng = _capture_rng()
        ctx.autocast = _capture_autocast()
        tensor_args = args[:num_tensor_args]
        ctx.other_args = args[num_tensor_args:]
        ctx.save_for_backward(*tensor_args)
        with torch.no_grad():
            return fn(*tensor_args, *ctx.other_args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        now = _capture_rng()
        _restore_rng(*ctx.rng)
        try:
            with torch.enable_grad(), _replay_autocast(ctx.autocast):
                outputs = ctx.fn(*inputs, *ctx.other_args)
        finally:
            _restore_rng(*now)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        return (None, None) + input_grads + (None,) * len(ctx.other_args)


# An engine with its own recompute (DeepSpeed's activation checkpointing, configured with the
# tracker above by megatron/integrations/deepspeed/) replaces the built-in one here; None:
# the built-in one.
_CHECKPOINT_IMPL: Optional[Callable[..., Any]] = None


def set_checkpoint_implementation(impl: Optional[Callable[..., Any]]) -> None:
    """Route ``checkpoint`` through ``impl(fn, *tensors)`` (None: the built-in recompute)."""
    global _CHECKPOINT_IMPL
    _CHECKPOINT_IMPL = impl


def checkpoint(fn: Callable[..., Any], *tensors: torch.Tensor, **_unused) -> Any:
    """Recompute ``fn(*tensors)`` in backward instead of storing its activations.

    Dropout inside ``fn`` draws the same masks in the recomputation as in the forward, for
    both the default generator and the tensor-parallel tracker. All arguments must be tensors
    (wrap other values in ``fn``'s closure); at least one should require grad.
    """
    if _CHECKPOINT_IMPL is not None:
        return _CHECKPOINT_IMPL(fn, *tensors)
    return _CheckpointFunction.apply(fn, len(tensors), *tensors)

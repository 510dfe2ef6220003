"""The micro-batch loop never waits for the device.

On a GPU, reading a tensor's value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``.cpu()``) blocks the Python thread until every queued kernel has run, so
the next micro-batch's kernels are not queued while the GPU works. Such reads belong after
the last micro-batch (the loss report, the grad norm), once per step. This test runs the
training step's micro-batch loop (``pretrain_gpt.forward_step``, the loss function, the
data-parallel wrapper's hooks, the optimizer's loss scaling) on the CPU under a
TorchFunctionMode that records every host read of a tensor: there must be none, whatever the
number of micro-batches. tests/gpu/test_cuda_speed_paths.py checks the same on CUDA with
torch's own sync detector.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pretrain_gpt
from megatron.assembly.build import RunContext
from megatron.config import parse_args
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.model.gpt_model import GPTModel

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
              "numpy"}


class HostReads(TorchFunctionMode):
    """Records the name of every tensor method that hands a value to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


CPU = torch.device("cpu")


def _step_setup(precision: list[str], device: torch.device = CPU):
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4",
                      "--mock-data", "--lr", "1e-3", "--vocab-size", "300",
                      # Per-document masks and positions: their EODs must not be looked up
                      # on the host either.
                      "--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask",
                      *precision])
    model = DistributedDataParallel(
        GPTModel(cfg.model, device=device), accumulate_allreduce_grads_in_fp32=True,
        gradient_accumulation_fusion=cfg.optimizer.gradient_accumulation_fusion)
    optimizer = get_megatron_optimizer(cfg.optimizer, [model])
    ctx = RunContext(cfg, tokenizer=SimpleNamespace(eod=0), device=device)
    return cfg, model, optimizer, ctx


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_micro_batch_loop_reads_nothing_back_from_the_device(precision, num_microbatches):
    model_parallel_seed(1234)  # attention dropout draws from the tracker's stream
    cfg, model, optimizer, ctx = _step_setup(precision)
    g = torch.Generator().manual_seed(0)
    samples = [{"text": torch.randint(0, 300, (2, 17), generator=g)}
               for _ in range(num_microbatches)]
    for sample in samples:
        sample["text"][:, 5] = 0  # an EOD in every row
    model.zero_grad_buffer()
    with HostReads() as reads:
        losses = forward_backward_no_pipelining(
            forward_step_func=functools.partial(pretrain_gpt.forward_step, ctx),
            data_iterator=iter(samples), model=[model], num_microbatches=num_microbatches,
            seq_length=16, micro_batch_size=2, grad_scale_func=optimizer.scale_loss)
    assert reads.seen == []
    # The loop did run: a loss per micro-batch and gradients in the buffer.
    assert len(losses) == num_microbatches
    assert all(p.main_grad.abs().sum() > 0 for p in model.module.parameters())


def test_the_recorder_sees_host_reads():
    """The check above can fail: the recorder catches each kind of read."""
    x = torch.ones(3)
    with HostReads() as reads:
        x.sum().item()
        float(x[0])
        bool(x.any())
        x.tolist()
        if x.sum() > 0:
            pass
    assert reads.seen == ["item", "__float__", "__bool__", "tolist", "__bool__"]

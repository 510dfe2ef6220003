"""The speed paths on a GPU (skipped where CUDA is not available).

- the fp32-output GEMM that gradient-accumulation fusion relies on under bf16 exists in this
  torch and adds into an fp32 buffer correctly; the fused and unfused bf16 gradients agree;
- the micro-batch loop queues its kernels without ever waiting for the GPU (torch's own
  synchronisation detector, set to raise);
- ``--compile`` trains to the eager run's losses (fp32, TF32 off) and learns in bf16.
"""

from __future__ import annotations

import functools

import pytest
import torch

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.tensor_parallel import model_parallel_seed
from tests.gpu.test_cuda_training import ON_GPU, argv, assert_close, losses, run_cli
from tests.unit.test_host_syncs import _step_setup

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


@pytest.fixture
def on_cuda():
    """Library calls in this process compute on the GPU (as initialize_megatron records)."""
    parallel_state.set_default_device(CUDA)
    try:
        yield CUDA
    finally:
        parallel_state.set_default_device(None)


def test_fp32_output_addmm_adds_into_an_fp32_buffer():
    from megatron.core.grad_accumulation import mixed_accumulation_works

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*s, generator=g).to(CUDA, torch.bfloat16) for s in ((256, 64), (64, 96)))
    c = torch.randn(256, 96, generator=g).to(CUDA)
    expected = c + a.double().mm(b.double()).float()
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError) as e:
        assert not mixed_accumulation_works(CUDA)
        pytest.skip(f"torch {torch.__version__} has no fp32-output addmm into an fp32 input "
                    f"({e}); bf16 weight gradients take the unfused path")
    torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-4)
    assert mixed_accumulation_works(CUDA)


def _bf16_main_grads(fusion: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.model.gpt_model import GPTModel
    from tests.unit.model.test_speed_paths import _tiny_config, _tokens

    config = _tiny_config(bf16=True)
    model = DistributedDataParallel(GPTModel(config, device=CUDA),
                                    accumulate_allreduce_grads_in_fp32=True,
                                    gradient_accumulation_fusion=fusion)
    model.zero_grad_buffer()
    for seed in (0, 1):
        tokens = _tokens(config, micro_batch=2 + seed).to(CUDA)
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    return {n: p.main_grad.float().cpu() for n, p in model.module.named_parameters()}


def test_bf16_fused_weight_gradients_match_the_unfused_ones(on_cuda):
    fused, plain = _bf16_main_grads(True), _bf16_main_grads(False)
    for name, grad in plain.items():
        scale = grad.abs().max()
        assert scale > 0, name
        # The fused GEMM keeps the product in fp32; the unfused one rounds it to bf16 first.
        torch.testing.assert_close(fused[name], grad, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_micro_batch_loop_never_waits_for_the_gpu(on_cuda, precision):
    model_parallel_seed(1234)
    cfg, model, optimizer, ctx = _step_setup(precision, device=CUDA)
    g = torch.Generator().manual_seed(0)
    samples = [{"text": torch.randint(0, 300, (2, 17), generator=g)} for _ in range(4)]
    for sample in samples:
        sample["text"][:, 5] = 0  # an EOD (the tokenizer's id 0) in every row
        sample["text"] = sample["text"].pin_memory()
    model.zero_grad_buffer()
    step = functools.partial(forward_backward_no_pipelining,
                             forward_step_func=functools.partial(pretrain_gpt.forward_step, ctx),
                             model=[model], num_microbatches=4, seq_length=16,
                             micro_batch_size=2, grad_scale_func=optimizer.scale_loss)
    step(data_iterator=iter(samples))  # first use: allocator growth, kernel loading, probes
    model.zero_grad_buffer()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses_ = step(data_iterator=iter(samples))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(losses_) == 4


def test_compile_matches_eager_on_the_gpu(corpus, cache):
    flags = {**ON_GPU, "--hidden-dropout": 0.0, "--attention-dropout": 0.0}
    eager = losses(run_cli(argv(corpus, cache, **flags)))
    compiled_out = run_cli(argv(corpus, cache, **flags, **{"--compile": True}))
    assert "--compile: 4 transformer layers" in compiled_out
    assert_close(losses(compiled_out), eager, rel=1e-4)
    bf16 = losses(run_cli(argv(corpus, cache, **ON_GPU, **{
        "--compile": True, "--bf16": True, "--train-iters": 30, "--lr": 3e-3})))
    assert bf16[-1] < bf16[0] - 0.5, bf16

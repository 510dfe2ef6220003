"""Generation on a GPU (skipped where CUDA is not available): fp32 on the GPU gives the CPU's
greedy tokens; bf16 and fp16 generate with the KV cache, their first greedy tokens agreeing
with fp32's and the cached path with the uncached one."""

from __future__ import annotations

import pytest
import torch

from megatron.inference.loading import build_inference_model
from megatron.inference.text_generation import SamplingParams, generate_tokens
from tests.unit.text_generation.hf_utils import converted, prompts, tiny_hf_model

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


def _model(device: str, dtype=None):
    config, full = converted(tiny_hf_model())
    return build_inference_model(config, device=torch.device(device), full_state_dict=full,
                                 dtype=dtype)


def test_fp32_on_gpu_equals_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cpu = generate_tokens(_model("cpu"), prompts(), 12).tokens
    gpu = generate_tokens(_model("cuda"), prompts(), 12).tokens
    assert gpu == cpu
    sampled = generate_tokens(_model("cuda"), prompts(), 12, seed=3,
                              params=SamplingParams(top_p=0.9))
    assert all(len(t) == len(p) + 12 for t, p in zip(sampled.tokens, prompts()))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_generation(dtype):
    fp32 = generate_tokens(_model("cuda"), prompts(), 3)
    model = _model("cuda", dtype)
    assert next(model.parameters()).dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cached = generate_tokens(model, prompts(), 3)
    plain = generate_tokens(model, prompts(), 3, use_cache=False)
    # The first new token of a random tiny model can flip on rounding; most must agree.
    firsts = [c[len(p)] == f[len(p)] for c, f, p in zip(cached.tokens, fp32.tokens, prompts())]
    assert sum(firsts) >= len(firsts) - 1
    same = [c[len(p)] == u[len(p)] for c, u, p in zip(cached.tokens, plain.tokens, prompts())]
    assert sum(same) >= len(same) - 1

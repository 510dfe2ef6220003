"""Generation at tensor parallel 2 and pipeline parallel 2 (real gloo groups) gives the
tokens and log-probabilities of one process, on every rank."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.text_generation import SamplingParams, generate_tokens
from megatron.text_generation.model_loading import build_inference_model
from tests.dist_utils import run_distributed
from tests.unit.text_generation.hf_utils import converted, prompts, tiny_hf_model

pytest.importorskip("transformers")

# (sampling, KV cache): greedy both ways, and nucleus sampling with the cache.
SETTINGS = [(SamplingParams(top_k=1), True), (SamplingParams(top_k=1), False),
            (SamplingParams(top_p=0.9, temperature=1.2), True)]


def _generate_all(tp: int, pp: int) -> list:
    hf = tiny_hf_model()
    config, full = converted(hf, tp, pp)
    model = build_inference_model(config, device=torch.device("cpu"), full_state_dict=full)
    out = []
    for params, use_cache in SETTINGS:
        r = generate_tokens(model, prompts(), 12, params=params, seed=5, use_cache=use_cache)
        out.append((r.tokens, r.logprobs))
    return out


def _on_ranks(rank, world_size, tp, pp):
    parallel_state.initialize_model_parallel(tp, pp)
    return _generate_all(tp, pp)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_parallel_generation_equals_one_process(tp, pp):
    reference = _generate_all(1, 1)
    results = run_distributed(_on_ranks, tp * pp, tp, pp)
    for rank, got in enumerate(results):
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, reference):
            assert tokens == ref_tokens, rank
            for a, b in zip(logprobs, ref_logprobs):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5,
                                           rtol=1e-5)

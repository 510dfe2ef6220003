"""Generation at tensor parallel 2 and at tensor 2 x pipeline 2 (real gloo groups) gives the
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


def _generate_all(config, full) -> list:
    model = build_inference_model(config, device=torch.device("cpu"), full_state_dict=full)
    out = []
    for params, use_cache in SETTINGS:
        r = generate_tokens(model, prompts(), 12, params=params, seed=5, use_cache=use_cache)
        out.append((r.tokens, r.logprobs))
    return out


def _on_ranks(rank, world_size, layouts):
    """Each (tp, pp, config, weights) in turn on the same 4 ranks (tp 2 alone runs as two
    data-parallel replicas)."""
    results = []
    for tp, pp, config, full in layouts:
        parallel_state.initialize_model_parallel(tp, pp)
        results.append(_generate_all(config, full))
        parallel_state.destroy_model_parallel()
    return results


def test_parallel_generation_equals_one_process():
    hf = tiny_hf_model()
    reference = _generate_all(*converted(hf))
    layouts = [(tp, pp, *converted(hf, tp, pp)) for tp, pp in ((2, 1), (2, 2))]
    for rank, per_layout in enumerate(run_distributed(_on_ranks, 4, layouts)):
        for (tp, pp, _, _), got in zip(layouts, per_layout):
            for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, reference):
                assert tokens == ref_tokens, (rank, tp, pp)
                for a, b in zip(logprobs, ref_logprobs):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5,
                                               rtol=1e-5)

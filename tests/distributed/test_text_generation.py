"""Generation at tensor parallel 2 and at tensor 2 x pipeline 2 (real gloo groups) gives the
tokens and log-probabilities of one process, on every rank (and so does scoring prompts); a checkpoint saved at tensor 2 x
pipeline 2 generates the same greedy tokens at its layout and read whole in one process."""

import pytest
import torch

from megatron.checkpointing.run_config import with_layout
from megatron.config import to_dict
from megatron.conversion.full import FullCheckpoint, save_full_checkpoint
from megatron.core import parallel_state
from megatron.inference.loading import build_inference_model, config_from_checkpoint
from megatron.inference.text_generation import SamplingParams, generate_tokens
from megatron.inference.text_generation.generation import score_tokens
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
    out.append((prompts(), score_tokens(model, prompts())))  # scoring: one forward, no cache
    return out


def _greedy_from_checkpoint(load_dir: str, world_size: int) -> list:
    config = config_from_checkpoint(load_dir, world_size)
    model = build_inference_model(config, device=torch.device("cpu"))
    return generate_tokens(model, prompts(), 12, params=SamplingParams(top_k=1)).tokens


def _save_tp2_pp2(hf, save_dir) -> str:
    """The converted HF model saved as our training saves at tensor 2 x pipeline 2."""
    config, state = converted(hf)
    data = {"tokenizer_type": "NullTokenizer", "vocab_size": 299}
    full = FullCheckpoint(config=with_layout({"model": to_dict(config.model), "data": data},
                                             1, 1), model=state, release=True)
    save_full_checkpoint(full, str(save_dir), 2, 2)
    return str(save_dir)


def _on_ranks(rank, world_size, layouts, load_dir):
    """Each (tp, pp, config, weights) in turn on the same 4 ranks (tp 2 alone runs as two
    data-parallel replicas), then ``load_dir``'s checkpoint at its saved layout (tp 2 x pp 2,
    each rank reading its own file)."""
    results = []
    for tp, pp, config, full in layouts:
        parallel_state.initialize_model_parallel(tp, pp)
        results.append(_generate_all(config, full))
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 2)
    saved_layout_tokens = _greedy_from_checkpoint(load_dir, world_size)
    parallel_state.destroy_model_parallel()
    return results, saved_layout_tokens


def test_parallel_generation_equals_one_process(tmp_path):
    hf = tiny_hf_model()
    reference = _generate_all(*converted(hf))
    load_dir = _save_tp2_pp2(hf, tmp_path / "tp2pp2")
    one_process = _greedy_from_checkpoint(load_dir, 1)  # merged and cut by conversion
    assert one_process == reference[0][0]  # greedy, KV cache, from the weights in memory
    layouts = [(tp, pp, *converted(hf, tp, pp)) for tp, pp in ((2, 1), (2, 2))]
    ranks = run_distributed(_on_ranks, 4, layouts, load_dir)
    for rank, (per_layout, at_saved_layout) in enumerate(ranks):
        assert at_saved_layout == one_process, rank
        for (tp, pp, _, _), got in zip(layouts, per_layout):
            for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, reference):
                assert tokens == ref_tokens, (rank, tp, pp)
                for a, b in zip(logprobs, ref_logprobs):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5,
                                               rtol=1e-5)


SCORED = ["5 6 7", "8 9 10 11 12 13"]


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()  # [s, V]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _serve_tp2(rank, world_size, config, full):
    """Rank 0 serves HTTP on 127.0.0.1 and hands each request to rank 1 (tensor parallel 2)."""
    import json
    import threading

    from werkzeug.serving import make_server

    from megatron.inference.text_generation.server import (
        build_app,
        serve_other_ranks,
        stop_other_ranks,
    )
    from megatron.inference.text_generation.setup import GenerationModel
    from megatron.tokenizer import build_tokenizer
    from tools.text_generation_cli import put

    parallel_state.initialize_model_parallel(world_size)
    model = build_inference_model(config, device=torch.device("cpu"), full_state_dict=full)
    gm = GenerationModel(model, build_tokenizer("NullTokenizer", vocab_size=299),
                         torch.device("cpu"), config)
    if rank != 0:
        serve_other_ranks(gm)
        return None
    server = make_server("127.0.0.1", 0, build_app(gm), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/api"
    try:
        replies = [put(url, {"prompts": ["5 6 7", "8"], "tokens_to_generate": 5, "top_k": 1}),
                   put(url, {"prompts": ["5 6 7"], "top_k": 1.5}),
                   put(url, {"prompts": ["9 9"], "tokens_to_generate": 3, "top_p": 0.8,
                             "random_seed": 4}),
                   put(url, {"prompts": SCORED, "tokens_to_generate": 0, "logprobs": True}),
                   put(url, {"prompts": SCORED, "tokens_to_generate": 4, "top_k": 1,
                             "logprobs": True})]
    finally:
        server.shutdown()
        stop_other_ranks()
    return [(status, json.loads(body) if status == 200 else body) for status, body in replies]


def test_server_on_two_tensor_parallel_ranks():
    from megatron.inference.text_generation import generate_text
    from megatron.tokenizer import build_tokenizer

    hf = tiny_hf_model()
    config, full = converted(hf)
    model = build_inference_model(config, device=torch.device("cpu"), full_state_dict=full)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=299)
    greedy = generate_text(model, tokenizer, ["5 6 7", "8"], 5)
    sampled = generate_text(model, tokenizer, ["9 9"], 3, seed=4,
                            params=SamplingParams(top_p=0.8))
    replies = run_distributed(_serve_tp2, 2, *converted(hf, 2))[0]
    assert replies[0] == (200, {"text": [c.prompt + c.text for c in greedy],
                                "segments": [[str(t) for t in c.tokens] for c in greedy],
                                "logprobs": None})
    assert replies[1][0] == 400 and "top_k" in replies[1][1]
    assert replies[2][1]["text"] == [sampled[0].prompt + sampled[0].text]
    # Scoring (tokens_to_generate 0) and logprobs of a generation over tp 2, through HTTP:
    # each token after the first, prompt and new ones, scored as HF's forward scores it.
    (status, scored), (status_gen, generated) = replies[3], replies[4]
    assert status == status_gen == 200 and scored["text"] == SCORED
    for reply, lengths in ((scored, [3, 6]), (generated, [7, 10])):
        assert [len(s) for s in reply["segments"]] == lengths
        for segments, logprobs in zip(reply["segments"], reply["logprobs"]):
            want = _hf_logprobs(hf, [int(t) for t in segments])
            torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), want,
                                       atol=1e-5, rtol=0)

"""Generation on one process: HF's greedy output, the KV cache against full recomputation,
sampling settings, stops."""

import pytest
import torch

from megatron.inference.loading import build_inference_model
from megatron.inference.text_generation import SamplingParams, generate_tokens, sample
from megatron.inference.text_generation.generation import score_tokens
from megatron.model.kv_cache import KVCache
from tests.unit.text_generation.hf_utils import converted, prompts, tiny_hf_model

pytest.importorskip("transformers")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf_model()
    config, full = converted(hf)
    return hf, build_inference_model(config, device=CPU, full_state_dict=full)


def test_greedy_equals_hf_generate_token_for_token(models):
    hf, ours = models
    batch = prompts()
    out = generate_tokens(ours, batch, 20)  # the batch together, prompts of 4 lengths
    for i, p in enumerate(batch):
        expected = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                               pad_token_id=0)[0].tolist()
        assert out.tokens[i] == expected, i
        assert len(out.new_tokens(i)) == 20


def test_cached_equals_uncached_for_every_setting(models):
    _, ours = models
    batch = prompts((4, 11, 6))
    for params in (SamplingParams(top_k=1), SamplingParams(temperature=0.7),
                   SamplingParams(top_k=5), SamplingParams(top_p=0.9, temperature=1.3)):
        cached = generate_tokens(ours, batch, 15, params=params, seed=3)
        plain = generate_tokens(ours, batch, 15, params=params, seed=3, use_cache=False)
        assert cached.tokens == plain.tokens, params
        for a, b in zip(cached.logprobs, plain.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_cached_logits_equal_full_forward_logits(models):
    _, ours = models
    ids = torch.tensor(prompts((12, 12)))
    with torch.no_grad():
        full = ours(ids)  # [b, s, V]
        cache = KVCache(2, 12)
        steps = [ours(ids[:, :5], inference_cache=cache)]  # a chunk of 5 positions, then 3
        steps += [ours(ids[:, 5:8], inference_cache=cache)]
        steps += [ours(ids[:, i:i + 1], inference_cache=cache) for i in range(8, 12)]
    got = torch.cat(steps, dim=1)  # last position of each chunk
    want = full[:, [4, 7, 8, 9, 10, 11]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.offset == 12


def test_seeded_sampling_repeats_and_differs_by_seed(models):
    _, ours = models
    batch = prompts((4, 6))
    params = SamplingParams(temperature=1.5)
    a = generate_tokens(ours, batch, 12, params=params, seed=11).tokens
    assert a == generate_tokens(ours, batch, 12, params=params, seed=11).tokens
    assert a != generate_tokens(ours, batch, 12, params=params, seed=12).tokens


def test_stops_at_eod_and_at_stop_check_and_context(models):
    _, ours = models
    batch = prompts((4, 6))
    free = generate_tokens(ours, batch, 10)
    eod = free.new_tokens(0)[3]  # the 4th id of sequence 0 becomes "end of document"
    out = generate_tokens(ours, batch, 10, eod=eod)
    assert out.new_tokens(0) == free.new_tokens(0)[:free.new_tokens(0).index(eod) + 1]
    stopped = generate_tokens(ours, batch, 10, stop=lambda i, new: i == 1 and len(new) == 2)
    assert stopped.new_tokens(1) == free.new_tokens(1)[:2]
    assert stopped.new_tokens(0) == free.new_tokens(0)
    near_end = generate_tokens(ours, [[1] * 44], 10)  # the context is 48 positions
    assert len(near_end.tokens[0]) == 48
    with pytest.raises(ValueError, match="no room"):
        generate_tokens(ours, [[1] * 48], 1)
    with pytest.raises(ValueError, match="token id 300, outside the model's vocabulary"):
        generate_tokens(ours, [[1, 300]], 1)


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 9.0]])
    assert sample(logits, SamplingParams(top_k=1)).item() == 4
    assert sample(logits, SamplingParams(top_k=1), vocab_size=4).item() == 1  # padding masked
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, SamplingParams(top_k=2), vocab_size=4, generator=g).item()
             for _ in range(200)}
    assert drawn == {1, 3}
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    drawn = {sample(probs, SamplingParams(top_p=0.75), generator=g).item() for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.75 needs the second; 0.8 >= 0.75 stops there
    # Top-k first, then top-p over the k renormalised: of 0.3 and 0.15 (2/3 and 1/3), 0.6
    # needs only the first; top-p alone at 0.6 would need 0.5 and 0.3.
    kept = {sample(probs, SamplingParams(top_k=3, top_p=0.6), generator=g).item()
            for _ in range(100)}
    assert kept == {0, 1}
    kept = {sample(probs[:, 1:], SamplingParams(top_k=2, top_p=0.6), generator=g).item()
            for _ in range(100)}
    assert kept == {0}
    with pytest.raises(ValueError):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.75, 40, 0.95), (1.0, 5, 0.5), (1.3, 200, 0.3), (0.5, 0, 0.9), (1.0, 7, 0.0),
    (0.9, 3, 1.0)])
def test_top_k_then_top_p_equals_hugging_face_warpers(temperature, top_k, top_p):
    """The logits drawn from equal those of HF's temperature, top-k and top-p warpers in
    ``generate``'s order, on a fixed batch: the same tokens cut, the same values kept."""
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from megatron.inference.text_generation.sampling import filter_logits

    logits = 3 * torch.randn(6, 300, generator=torch.Generator().manual_seed(11))  # [b, V]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if 0 < top_p < 1:  # generate adds no top-p warper at 1.0
        warpers.append(TopPLogitsWarper(top_p))
    want = warpers(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    got = filter_logits(logits, SamplingParams(temperature, top_k, top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = ~torch.isinf(want)
    assert 0 < kept.sum() < logits.numel()  # something is cut, something kept
    torch.testing.assert_close(got[kept], want[kept], rtol=1e-6, atol=1e-6)


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """HF's log-probability of each id from the second on: log_softmax of its logits."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()  # [s, V]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_prompt_scores_equal_hf_log_softmax(models):
    """Scoring (Megatron's tokens_to_generate 0): one forward over prompts of different
    lengths; a prompt may fill the whole context."""
    hf, ours = models
    batch = prompts((5, 9, 1, 48))
    scores = score_tokens(ours, batch)
    assert [len(s) for s in scores] == [4, 8, 0, 47]
    for ids, got in zip(batch, scores):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), _hf_logprobs(hf, ids),
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="49 tokens, more than the model's context of 48"):
        score_tokens(ours, [[1] * 49])


def test_whole_sequence_logprobs_of_a_completion_equal_hf(models):
    """generate_text with prompt_logprobs: the prompt's scores followed by the new tokens'
    score every token after the first, as HF's forward over the whole sequence does; with
    0 new tokens only the prompt is scored."""
    from megatron.inference.text_generation import generate_text
    from megatron.tokenizer import build_tokenizer

    hf, ours = models
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=299)
    texts = ["5 6 7 8", "9 10", "11 12 13 14 15 16"]
    done = generate_text(ours, tokenizer, texts, 6, stop_on_eod=False, prompt_logprobs=True)
    scored = generate_text(ours, tokenizer, texts, 0, prompt_logprobs=True)
    for c, s in zip(done, scored):
        assert len(c.tokens) == c.prompt_length + 6 and len(c.prompt_logprobs) == c.prompt_length - 1
        whole = torch.tensor(c.prompt_logprobs + c.logprobs, dtype=torch.float64)
        torch.testing.assert_close(whole, _hf_logprobs(hf, c.tokens), atol=1e-5, rtol=0)
        assert (s.text, s.tokens, s.logprobs) == ("", c.tokens[:c.prompt_length], [])
        torch.testing.assert_close(s.prompt_logprobs, c.prompt_logprobs, atol=1e-9, rtol=0)
    assert generate_text(ours, tokenizer, texts[:1], 2)[0].prompt_logprobs == []

"""Hugging Face's Llama family through tools/checkpoint/convert.py: small LlamaForCausalLM (4
query heads, 2 key/value heads, untied), MistralForCausalLM and Qwen2ForCausalLM (QKV biases,
tied), built here with non-trivial norm weights and biases, convert into ours with their
logits (fp32), train on from their weights at tp 1, tp 2, pp 2 and tp 2 x pp 2 (the first
step's loss is HF's loss on that batch), and come back as folders from_pretrained loads with
the same logits."""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megatron.conversion import load_full_checkpoint
from megatron.data.mock_dataset import MockGPTDataset
from megatron.model.gpt_model import GPTModel
from tests.dist_utils import run_distributed
from tests.functional.hf_models import build_hf_model, run_convert, save_hf_models

transformers = pytest.importorskip("transformers")

VOCAB = 128  # a multiple of 64 x tp: the same padding (none) at tp 1 and tp 2
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return save_hf_models(tmp_path_factory, {
        family: build_hf_model(FAMILIES[family], SHAPE) for family in FAMILIES})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_model_gives_hf_logits_and_converts_back(hf_dirs, tmp_path, family):
    path, hf = hf_dirs[family]
    ours_dir, back = tmp_path / "ours", tmp_path / "back"
    run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", path,
             "--save-dir", ours_dir, "--make-vocab-size-divisible-by", 64)
    full = load_full_checkpoint(str(ours_dir))
    config = full.model_config()
    assert (config.num_query_groups, config.swiglu, config.normalization) == (2, True, "RMSNorm")
    model = GPTModel(config).eval()
    model.load_state_dict(full.model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids)[..., :VOCAB], want, atol=1e-5, rtol=1e-5)
    run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", ours_dir,
             "--save-dir", back)
    again = getattr(transformers, FAMILIES[family][1]).from_pretrained(back).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, atol=1e-5, rtol=1e-5)
    assert again.config.num_key_value_heads == 2
    assert again.config.tie_word_embeddings == hf.config.tie_word_embeddings


def _finetune(rank, world_size, argv):
    return [h["losses"]["lm loss"] for h in pretrain_gpt.main(argv).history if h["losses"]]


# tp 1 is the logits test's; Mistral's weights are Llama's (its logits test covers them).
LAYOUTS = [("llama", 2, 1), ("llama", 1, 2), ("llama", 2, 2), ("qwen2", 2, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,pp", LAYOUTS,
                         ids=[f"{f}-tp{t}pp{p}" for f, t, p in LAYOUTS])
def test_converted_checkpoint_trains_from_hf_weights(hf_dirs, tmp_path, family, tp, pp):
    """--load CONVERTED --use-checkpoint-args --finetune at the converted layout: the first
    step's loss is HF's own loss on the first mock batch."""
    path, hf = hf_dirs[family]
    ckpt = tmp_path / "ckpt"
    run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", path, "--save-dir", ckpt,
             "--make-vocab-size-divisible-by", 64, "--target-tensor-parallel-size", tp,
             "--target-pipeline-parallel-size", pp)
    argv = ["--load", str(ckpt), "--use-checkpoint-args", "--finetune", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--hidden-dropout", "0", "--attention-dropout",
            "0", "--eval-iters", "0", "--num-workers", "0", "--use-cpu",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    losses = [run for run in run_distributed(_finetune, tp * pp, argv) if run][-1]
    data = MockGPTDataset(4, 32, VOCAB, seed=1234)
    tokens = torch.stack([torch.from_numpy(data[i]["text"]) for i in range(2)]).long()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            hf(tokens[:, :-1]).logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert len(losses) == 2
    assert losses[0] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_hf_generate(hf_dirs, family):
    """Cached greedy decoding (the KV cache holding the key/value heads only) gives HF's
    generate token for token; so does the uncached path."""
    from megatron.inference.text_generation.generation import generate_tokens
    from megatron.model.hf_llama import hf_llama_to_megatron_state_dict, model_config_from_hf_llama

    _, hf = hf_dirs[family]
    config = model_config_from_hf_llama(hf.config.to_dict(), make_vocab_size_divisible_by=64)
    model = GPTModel(config).eval()
    model.load_state_dict(hf_llama_to_megatron_state_dict(hf.state_dict(), config))
    prompts = [[5, 17, 99, 3], [42, 7]]
    for use_cache in (True, False):
        out = generate_tokens(model, prompts, 12, use_cache=use_cache)
        for prompt, tokens in zip(prompts, out.tokens):
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0].tolist()
            assert tokens == want, (use_cache, tokens, want)

import pytest
import torch

from megatron.model.gpt_model import GPTModel
from megatron.model.hf_gpt2 import (
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
    model_config_from_hf,
)

transformers = pytest.importorskip("transformers")


def _random_hf_model(**shape):
    cfg = transformers.GPT2Config(
        vocab_size=1000, n_positions=32, n_embd=64, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **shape)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # LayerNorm weights 1 and biases 0 would hide layout mistakes
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def test_hf_gpt2_logits_match():
    hf = _random_hf_model()
    config = model_config_from_hf(hf.config)
    assert config.activation == "gelu_tanh" and config.padded_vocab_size == 1024
    ours = GPTModel(config, parallel_output=True).eval()
    missing = ours.load_state_dict(hf_to_megatron_state_dict(hf.state_dict(), config))
    assert not missing.missing_keys and not missing.unexpected_keys
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)[..., :1000]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # The loss path agrees with HF's shifted loss once no padded rows join the softmax.
    config = model_config_from_hf(hf.config, make_vocab_size_divisible_by=8)
    assert config.padded_vocab_size == 1000
    ours = GPTModel(config).eval()
    ours.load_state_dict(hf_to_megatron_state_dict(hf.state_dict(), config))
    with torch.no_grad():
        per_token = ours(ids[:, :-1], labels=ids[:, 1:])
        hf_loss = hf(ids, labels=ids).loss
    torch.testing.assert_close(per_token.mean(), hf_loss, atol=1e-4, rtol=1e-4)


def test_round_trip_back_to_hf():
    hf = _random_hf_model()
    config = model_config_from_hf(hf.config)
    sd = hf_to_megatron_state_dict(hf.state_dict(), config)
    back = megatron_to_hf_state_dict(sd, config)
    for name, tensor in hf.state_dict().items():
        if name in back:
            torch.testing.assert_close(back[name], tensor, atol=0, rtol=0)
    assert "transformer.h.2.attn.c_attn.weight" in back and "lm_head.weight" in back

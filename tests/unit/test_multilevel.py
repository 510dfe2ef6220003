"""The multi-level operators (issue 15, item 1): shapes, exact round trips, interpolation,
and the authors' published GPT-2 coalescing."""

import re

import pytest
import torch

from megatron.config import ModelConfig, to_dict
from megatron.model.gpt_model import GPTModel
from megatron.research.multilevel import (
    MultilevelError,
    coalesce,
    decoalesce,
    interpolate,
    pair_index,
)


def _config(**changes) -> ModelConfig:
    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                  attention_dropout=0.0)
    fields.update(changes)
    return ModelConfig(**fields)


def _random_state(config: ModelConfig, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = GPTModel(config)
    with torch.no_grad():  # LayerNorm weights 1 and biases 0 would hide mapping mistakes
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.state_dict()


def _logits(state: dict, config: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    model = GPTModel(config).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
def test_pair_index(pairing):
    a, b = pair_index(8, pairing, chunk=2)  # 4 heads of 2 channels
    if pairing == "adjacent":
        assert a.tolist() == [0, 1, 4, 5] and b.tolist() == [2, 3, 6, 7]
    else:
        assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6, 7]
    with pytest.raises(MultilevelError, match="pairs"):
        pair_index(6, pairing, chunk=2)


@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
@pytest.mark.parametrize("width,depth", [(True, True), (True, False), (False, True)])
def test_coalesce_then_decoalesce_gives_the_original_shapes(pairing, width, depth):
    config = _config()
    state = _random_state(config)
    small, small_config = coalesce(state, config, width=width, depth=depth, pairing=pairing)
    assert small_config.num_layers == (2 if depth else 4)
    assert small_config.hidden_size == (16 if width else 32)
    assert small_config.num_attention_heads == (2 if width else 4)
    assert small_config.kv_channels == config.kv_channels == 8
    assert GPTModel(small_config).load_state_dict(small)  # the small model takes the weights
    large, large_config = decoalesce(small, small_config, width=width, depth=depth,
                                     pairing=pairing)
    assert to_dict(large_config) == to_dict(config)
    assert {k: v.shape for k, v in large.items()} == {k: v.shape for k, v in state.items()}


@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
def test_round_trip_on_a_model_with_equal_neighbours_keeps_its_logits(pairing):
    """A de-coalesced model has equal neighbouring neurons, heads and layers by construction;
    coalescing it and de-coalescing again gives the same function (logits within 1e-5)."""
    small_config = _config(num_layers=2, hidden_size=16, num_attention_heads=2, kv_channels=8)
    small = _random_state(small_config, seed=1)
    equal, config = decoalesce(small, small_config, pairing=pairing)
    a, b = pair_index(config.hidden_size, pairing)
    w = equal["encoder.layers.2.mlp.dense_h_to_4h.weight"]
    assert torch.equal(w[:, a], w[:, b])  # neighbours equal: the test's premise
    assert torch.equal(w, equal["encoder.layers.3.mlp.dense_h_to_4h.weight"])

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    expected = _logits(equal, config, ids)
    again, again_config = decoalesce(*coalesce(equal, config, pairing=pairing), pairing=pairing)
    torch.testing.assert_close(_logits(again, again_config, ids), expected, atol=1e-5, rtol=0)
    # and de-coalescing is the right inverse of coalescing, exactly
    back, _ = coalesce(equal, config, pairing=pairing)
    for key, t in small.items():
        torch.testing.assert_close(back[key], t, atol=1e-6, rtol=0)


def test_round_trip_changes_a_generic_model():
    """The check above can fail: a model without equal neighbours is not a fixed point."""
    config = _config()
    state = _random_state(config)
    again, _ = decoalesce(*coalesce(state, config))
    key = "encoder.layers.0.mlp.dense_h_to_4h.weight"
    assert (again[key] - state[key]).abs().max() > 1e-2


def test_coalesce_definitions_on_one_matrix():
    """Output rows of a pair are averaged, input columns summed; embeddings summed."""
    config = _config(num_layers=2)
    state = _random_state(config)
    small, _ = coalesce(state, config, depth=False)
    w = state["encoder.layers.0.mlp.dense_h_to_4h.weight"]  # [ffn, h]
    expected = (w[0::2] + w[1::2]) / 2
    expected = expected[:, 0::2] + expected[:, 1::2]
    torch.testing.assert_close(small["encoder.layers.0.mlp.dense_h_to_4h.weight"], expected)
    emb = state["embedding.word_embeddings.weight"]
    torch.testing.assert_close(small["embedding.word_embeddings.weight"],
                               emb[:, 0::2] + emb[:, 1::2])
    deep, _ = coalesce(state, config, width=False)
    torch.testing.assert_close(
        deep["encoder.layers.0.self_attention.dense.bias"],
        (state["encoder.layers.0.self_attention.dense.bias"]
         + state["encoder.layers.1.self_attention.dense.bias"]) / 2)


def test_interpolate_ends_are_exact():
    config = _config()
    large = _random_state(config, seed=3)
    other = _random_state(config, seed=4)
    for alpha, expected in ((0.0, large), (1.0, other)):
        out = interpolate(large, other, alpha)
        assert all(torch.equal(out[k], expected[k]) for k in large)
    mid = interpolate(large, other, 0.25)
    key = "final_layernorm.weight"
    torch.testing.assert_close(mid[key], 0.75 * large[key] + 0.25 * other[key])
    with pytest.raises(MultilevelError, match="alpha"):
        interpolate(large, other, 1.5)
    small, _ = coalesce(large, config)
    with pytest.raises(MultilevelError, match="parameters|shapes"):
        interpolate(large, small, 0.5)


def test_odd_sizes_are_refused():
    config = _config(num_layers=3)
    with pytest.raises(MultilevelError, match="--num-layers 3"):
        coalesce(_random_state(config), config)
    coalesce(_random_state(config), config, depth=False)  # width alone is fine


def _mean_rows(n: int) -> torch.Tensor:
    """[n/2, n]: row i averages i and i + n/2 (the authors' default map, ``embed_F``)."""
    eye = torch.eye(n // 2)
    return torch.cat([eye, eye], dim=1) / 2


def _authors_coalesce(hf: dict, n_layer: int, h: int, ffn: int) -> dict:
    """The published GPT-2 coalescing written as matrices on the HF state dict (weights in
    HF's [in, out] Conv1D layout): output rows ``F W``, input columns ``W F^T`` renormalised to
    sums, embeddings ``2 W F^T``, layers averaged in pairs."""
    Fh, Ff = _mean_rows(h), _mean_rows(ffn)
    Sh, Sf = (Fh.t() > 0).float(), (Ff.t() > 0).float()  # [n, n/2]: sums of pairs

    def linear(w, b, f_out, s_in):  # HF: w [in, out]
        return (f_out @ w.t() @ s_in).t(), f_out @ b

    out = {"transformer.wte.weight": hf["transformer.wte.weight"] @ Fh.t() * 2,
           "transformer.wpe.weight": hf["transformer.wpe.weight"] @ Fh.t() * 2,
           "transformer.ln_f.weight": Fh @ hf["transformer.ln_f.weight"],
           "transformer.ln_f.bias": Fh @ hf["transformer.ln_f.bias"]}
    layers = []
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        lay = {}
        for ln in ("ln_1", "ln_2"):
            lay[ln + ".weight"] = Fh @ hf[p + ln + ".weight"]
            lay[ln + ".bias"] = Fh @ hf[p + ln + ".bias"]
        qkv_w = hf[p + "attn.c_attn.weight"].chunk(3, dim=1)
        qkv_b = hf[p + "attn.c_attn.bias"].chunk(3)
        parts = [linear(w, b, Fh, Sh) for w, b in zip(qkv_w, qkv_b)]
        lay["attn.c_attn.weight"] = torch.cat([w for w, _ in parts], dim=1)
        lay["attn.c_attn.bias"] = torch.cat([b for _, b in parts])
        for name, f_out, s_in in (("attn.c_proj", Fh, Sh), ("mlp.c_fc", Ff, Sh),
                                  ("mlp.c_proj", Fh, Sf)):
            lay[name + ".weight"], lay[name + ".bias"] = linear(
                hf[p + name + ".weight"], hf[p + name + ".bias"], f_out, s_in)
        layers.append(lay)
    for i in range(n_layer // 2):
        for name in layers[0]:
            out[f"transformer.h.{i}.{name}"] = (layers[2 * i][name] + layers[2 * i + 1][name]) / 2
    return out


def test_halves_pairing_matches_the_authors_gpt2_coalescing():
    transformers = pytest.importorskip("transformers")
    from megatron.model.hf_gpt2 import hf_to_megatron_state_dict, model_config_from_hf

    hf_config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4,
                                        n_head=4)
    torch.manual_seed(5)
    hf = transformers.GPT2LMHeadModel(hf_config).state_dict()
    hf = {k: v + 0.1 * torch.randn_like(v) for k, v in hf.items()
          if not re.search(r"\.attn\.(masked_)?bias$", k)}  # buffers of older versions
    config = model_config_from_hf(hf_config, make_vocab_size_divisible_by=8)
    ours, small_config = coalesce(hf_to_megatron_state_dict(hf, config), config,
                                  pairing="halves")
    theirs = _authors_coalesce(hf, 4, 32, 128)
    expected = hf_to_megatron_state_dict(theirs, small_config)
    assert set(ours) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("variant", [
    {"untie_embeddings_and_output_weights": True},
    {"position_embedding_type": "rope", "add_bias_linear": False},
])
def test_round_trip_covers_untied_output_rope_and_no_biases(variant):
    small_config = _config(num_layers=2, hidden_size=16, num_attention_heads=2, kv_channels=8,
                           **variant)
    small = _random_state(small_config, seed=6)
    equal, config = decoalesce(small, small_config)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(7))
    again, again_config = decoalesce(*coalesce(equal, config))
    torch.testing.assert_close(_logits(again, again_config, ids), _logits(equal, config, ids),
                               atol=1e-5, rtol=0)
    assert ("output_layer.weight" in small) == bool(
        variant.get("untie_embeddings_and_output_weights"))

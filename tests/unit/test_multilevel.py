"""The multi-level operators (issue 15, item 1): shapes, exact round trips, interpolation."""

import pytest
import torch

from megatron.config import ModelConfig, to_dict
from megatron.model.gpt_model import GPTModel
from megatron.multilevel import (
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

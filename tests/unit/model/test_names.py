"""megatron/model/names.py describes the model: every chunk's named_parameters() are its
names in its order, and each parameter's tensor-parallel cut is the one its layer makes."""

from __future__ import annotations

import pytest

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.model import names
from megatron.model.gpt_model import GPTModel

CHUNKS = [(True, True), (True, False), (False, False), (False, True)]
# Experts with a gated shared expert (its gate_weight registered before its linear layers).
GATED_MOE = {"num_experts": 2, "swiglu": True, "ffn_hidden_size": 32,
             "moe_shared_expert_intermediate_size": 8,
             "moe_shared_expert_gate": True}


@pytest.mark.parametrize("pre, post", CHUNKS)
@pytest.mark.parametrize("variant", [{}, {"untie_embeddings_and_output_weights": True},
                                     {"add_bias_linear": False},
                                     {"position_embedding_type": "rope"}, GATED_MOE])
def test_chunk_names_are_the_models_named_parameters(pre, post, variant):
    parallel_state.destroy_model_parallel()
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                         vocab_size=30, **variant)
    model = GPTModel(config, pre_process=pre, post_process=post, device="meta")
    ours = [name for name, _ in model.named_parameters()]
    assert ours == names.chunk_names(config, 2, pre, post)
    assert sorted(ours, key=names.model_order_key) == ours


def test_the_tensor_parallel_cut_is_the_layers_own():
    parallel_state.destroy_model_parallel()
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                         vocab_size=30, untie_embeddings_and_output_weights=True, **GATED_MOE)
    model = GPTModel(config, device="meta")
    assert names.layer_key(0, names.SHARED_EXPERT_GATE) in dict(model.named_parameters())
    for name, param in model.named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", None) if split else None
        assert names.tp_split_dim(name) == dim, name
    assert names.tp_split_dim(names.TIED_COPY) == 0


def test_layer_keys_round_trip():
    key = names.layer_key(7, "mlp.dense_4h_to_h.bias")
    assert key == "encoder.layers.7.mlp.dense_4h_to_h.bias"
    assert names.parse_layer_key(key) == (7, "mlp.dense_4h_to_h.bias")
    assert names.parse_layer_key(names.FINAL_NORM[0]) is None
    assert names.renumber_layer(key, -3) == "encoder.layers.4.mlp.dense_4h_to_h.bias"
    assert names.renumber_layer(names.WORD_EMBEDDINGS, 2) == names.WORD_EMBEDDINGS

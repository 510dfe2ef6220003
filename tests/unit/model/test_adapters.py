"""Every outside layout follows model/adapters.py's protocol: from_ours then to_ours gives our
state back exactly, and the outside names are the outside program's."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron.checkpointing.folder import latest_checkpoint
from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.model import adapters
from megatron.model.gpt_model import GPTModel
from megatron.model.hf_llama import fit_to_model
from megatron.model.names import VOCAB_TENSORS

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fixtures",
                        "checkpoints_v1")
GPT = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=30)
LLAMA = dict(GPT, num_attention_heads=4, normalization="RMSNorm", swiglu=True,
             num_query_groups=2, group_query_attention=True, add_bias_linear=False,
             position_embedding_type="rope", ffn_hidden_size=24)
MIXTRAL = dict(LLAMA, num_experts=3, moe_ffn_hidden_size=8)  # experts in every layer
QWEN2_MOE = dict(MIXTRAL, moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True,
                 moe_layer_freq="[1,0]", add_qkv_bias=True)
CASES = [("hf_gpt2", GPT), ("hf_gpt2", dict(GPT, untie_embeddings_and_output_weights=True)),
         ("hf_llama", LLAMA), ("hf_llama", dict(LLAMA, untie_embeddings_and_output_weights=True)),
         ("hf_llama", MIXTRAL), ("hf_llama", QWEN2_MOE),
         ("mcore", GPT), ("mcore", LLAMA), ("mcore", MIXTRAL), ("mcore", QWEN2_MOE),
         ("mcore", dict(MIXTRAL, swiglu=False, add_bias_linear=True)),
         ("mcore", dict(MIXTRAL, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True)),
         ("megatron_deepspeed", GPT),
         ("megatron_deepspeed", dict(GPT, untie_embeddings_and_output_weights=True))]


def _whole_state(fields: dict) -> tuple[ModelConfig, dict]:
    parallel_state.destroy_model_parallel()
    config = ModelConfig(**fields)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in GPTModel(config).state_dict().items()}
    for name in set(state) & set(VOCAB_TENSORS):  # outside layouts keep no padding rows
        state[name][config.vocab_size:] = 0
    return config, state


@pytest.mark.parametrize("name, fields", CASES)
def test_from_ours_then_to_ours_is_our_state(name, fields):
    adapter = adapters.ADAPTERS[name]
    config, ours = _whole_state(fields)
    theirs = adapter.from_ours(ours, config)
    assert set(theirs) != set(ours)  # it does rename
    back = adapter.to_ours(theirs, config)
    assert sorted(back) == sorted(ours)
    for key in ours:
        torch.testing.assert_close(back[key], ours[key], rtol=0, atol=0, msg=key)


def test_the_mcore_names_are_those_a_torch_dist_checkpoint_stores():
    folder = latest_checkpoint(os.path.join(FIXTURES, "torch_dist"))
    stored = {k for k in FileSystemReader(folder.path).read_metadata().state_dict_metadata
              if not k.startswith(("optimizer.", "rng_state")) and "_extra_state" not in k}
    model = folder.config()["model"]
    config, ours = _whole_state({k: model[k] for k in ("num_layers", "hidden_size",
                                                         "num_attention_heads", "seq_length",
                                                         "vocab_size", "max_position_embeddings",
                                                         "make_vocab_size_divisible_by")})
    assert set(adapters.ADAPTERS["mcore"].from_ours(ours, config)) == stored


def test_megatron_deepspeed_nesting_is_their_language_model_entry():
    config, ours = _whole_state(dict(GPT, untie_embeddings_and_output_weights=True))
    theirs = adapters.ADAPTERS["megatron_deepspeed"].from_ours(ours, config)
    lm = theirs["language_model"]
    assert sorted(lm) == ["embedding", "encoder", "output_layer"]
    assert sorted(lm["embedding"]) == ["position_embeddings", "word_embeddings"]
    assert "layers.1.self_attention.query_key_value.weight" in lm["encoder"]
    assert "final_layernorm.weight" in lm["encoder"] and list(lm["output_layer"]) == ["weight"]


HF_MOE_SHAPE = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=30, num_experts_per_tok=2)


def test_hugging_face_names_are_the_transformers_models_own():
    transformers = pytest.importorskip("transformers")
    for name, fields, make in [
            ("hf_gpt2", GPT, lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=2, n_embd=16, n_head=2, n_positions=8, vocab_size=30))),
            ("hf_llama", LLAMA, lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                num_hidden_layers=2, hidden_size=16, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=24, vocab_size=30,
                tie_word_embeddings=True))),
            ("hf_llama", MIXTRAL, lambda: transformers.MixtralForCausalLM(
                transformers.MixtralConfig(**HF_MOE_SHAPE, num_local_experts=3,
                                           intermediate_size=8))),
            ("hf_llama", QWEN2_MOE, lambda: transformers.Qwen2MoeForCausalLM(
                transformers.Qwen2MoeConfig(**HF_MOE_SHAPE, num_experts=3, intermediate_size=24,
                                            moe_intermediate_size=8, mlp_only_layers=[1],
                                            shared_expert_intermediate_size=12)))]:
        config, ours = _whole_state(fields)
        expected = set(make().state_dict())
        # transformers 5 holds each layer's experts fused: fit_to_model gives it that form.
        theirs = set(fit_to_model(adapters.ADAPTERS[name].from_ours(ours, config), expected))
        assert expected - theirs <= {"lm_head.weight"} and theirs - expected <= {"lm_head.weight"}

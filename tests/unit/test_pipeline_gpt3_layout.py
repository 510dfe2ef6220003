"""GPT-3 175B on 64 ranks (tensor 8 x pipeline 8), checked without launching it.

Each inspected rank's stage is built on PyTorch's meta device (shapes, no memory), as that
rank of the layout would build it: its 12 of the 96 layers, the embeddings on the first
stage, the final LayerNorm and the tied word-embedding copy on the last.
"""

from __future__ import annotations

import pytest
import torch

from megatron.config import layer_range, parse_args
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import assume_tensor_parallel_rank
from megatron.model.gpt_model import GPTModel

TP, PP, WORLD = 8, 8, 64
L, H, HEADS, SEQ, GPT2_VOCAB = 96, 12288, 96, 2048, 50257

GPT3_175B_FLAGS = [
    "--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--tensor-model-parallel-size", str(TP), "--pipeline-model-parallel-size", str(PP),
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--train-iters", "10",
    "--lr", "6e-5", "--fp16", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(GPT2_VOCAB),
]


@pytest.fixture(scope="module")
def config():
    return parse_args(GPT3_175B_FLAGS, world_size=WORLD).with_vocab_size(GPT2_VOCAB)


def coordinates(rank: int) -> tuple[int, int]:
    """(tensor rank, pipeline rank) of a global rank: tensor fastest, then data (1), then
    pipeline, as Megatron lays them out."""
    groups = parallel_state.build_rank_groups(WORLD, TP, PP)
    return (groups.containing("tensor", rank).index(rank),
            groups.containing("pipeline", rank).index(rank))


def build_stage(config, rank: int) -> GPTModel:
    tp_rank, pp_rank = coordinates(rank)
    first_layer, num_layers = layer_range(config.pipeline_stage_num_layers, pp_rank)
    model_config = config.model.replace(perform_initialization=False)
    with assume_tensor_parallel_rank(TP, tp_rank):
        return GPTModel(model_config, pre_process=pp_rank == 0, post_process=pp_rank == PP - 1,
                        first_layer=first_layer, num_layers=num_layers, device="meta")


def layer_shapes() -> dict[str, tuple[int, ...]]:
    """One transformer layer's parameters on one tensor rank."""
    qkv, ffn = 3 * H // TP, 4 * H // TP
    return {
        "input_layernorm.weight": (H,), "input_layernorm.bias": (H,),
        "self_attention.query_key_value.weight": (qkv, H),
        "self_attention.query_key_value.bias": (qkv,),
        "self_attention.dense.weight": (H, H // TP), "self_attention.dense.bias": (H,),
        "post_attention_layernorm.weight": (H,), "post_attention_layernorm.bias": (H,),
        "mlp.dense_h_to_4h.weight": (ffn, H), "mlp.dense_h_to_4h.bias": (ffn,),
        "mlp.dense_4h_to_h.weight": (H, ffn), "mlp.dense_4h_to_h.bias": (H,),
    }


def test_config_splits_96_layers_into_8_stages_of_12(config):
    assert config.parallel.data_parallel_size == 1
    assert config.pipeline_stage_num_layers == (12,) * PP
    assert [layer_range(config.pipeline_stage_num_layers, p) for p in range(PP)] == \
        [(12 * p, 12) for p in range(PP)]
    assert config.model.padded_vocab_size == 51200  # 50257 up to a multiple of 128 x 8
    assert config.model.params_dtype == torch.float16


@pytest.mark.parametrize("rank", [0, 7, 8, 29, 56, 63])
def test_stage_parameters_on_meta(config, rank):
    tp_rank, pp_rank = coordinates(rank)
    model = build_stage(config, rank)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.float16 for p in params.values())

    layers = model.encoder.layers
    assert [layer.layer_number for layer in layers] == list(range(12 * pp_rank + 1,
                                                                  12 * pp_rank + 13))
    expected = {f"encoder.layers.{i}.{name}": shape
                for i in range(12) for name, shape in layer_shapes().items()}
    vocab_rows = 51200 // TP
    if pp_rank == 0:
        expected["embedding.word_embeddings.weight"] = (vocab_rows, H)
        expected["embedding.position_embeddings.weight"] = (SEQ, H)
        embedding = model.embedding.word_embeddings
        assert embedding.vocab_start_index == tp_rank * vocab_rows
    if pp_rank == PP - 1:
        expected["final_layernorm.weight"] = expected["final_layernorm.bias"] = (H,)
        expected["word_embeddings.weight"] = (vocab_rows, H)  # the tied copy
        assert model.word_embeddings.vocab_start_index == tp_rank * vocab_rows
        assert getattr(model.word_embeddings.weight, "shared", False)
    assert {name: tuple(p.shape) for name, p in params.items()} == expected
    assert model.shared_embedding_or_output_weight() is (
        params.get("embedding.word_embeddings.weight") if pp_rank == 0
        else params.get("word_embeddings.weight"))


def test_all_stages_add_up_to_175b(config):
    """Tensor-rank-0 stages, shards counted TP times and replicas once, tied copy not at all,
    give GPT-3's 175B parameters."""
    total = 0
    for pp_rank in range(PP):
        model = build_stage(config, pp_rank * TP)
        for p in model.parameters():
            if getattr(p, "shared", False):
                continue
            total += p.numel() * (TP if getattr(p, "tensor_model_parallel", False) else 1)
    per_layer = 12 * H * H + 13 * H
    assert total == L * per_layer + 51200 * H + SEQ * H + 2 * H == 174_615_846_912


def test_embedding_group_joins_first_and_last_stage_of_each_tensor_rank():
    groups = parallel_state.build_rank_groups(WORLD, TP, PP)
    assert groups.containing("tensor", 0) == list(range(8))
    assert groups.containing("pipeline", 0) == list(range(0, 64, 8))
    for t in range(TP):
        assert groups.containing("embedding", t) == [t, 56 + t]
        assert groups.containing("embedding", 56 + t) == [t, 56 + t]
        assert coordinates(t) == (t, 0) and coordinates(56 + t) == (t, PP - 1)
        assert groups.containing("position_embedding", t) == [t]
    assert groups.containing("embedding", 29) == []  # a middle stage holds no embedding
    assert len(groups.embedding) == TP


def test_assumed_rank_is_scoped_and_checked():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    with assume_tensor_parallel_rank(4, 3):
        inside = ColumnParallelLinear(8, 16, init_method=None, device="meta")
    outside = ColumnParallelLinear(8, 16, init_method=None, device="meta")
    assert inside.weight.shape == (4, 8) and outside.weight.shape == (16, 8)
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        with assume_tensor_parallel_rank(4, 4):
            pass

import pytest

from megatron.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    layer_range,
    split_pipeline_layers,
)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(hidden_size=30, num_attention_heads=4), r"--hidden-size \(30\).*--num-attention-heads \(4\)"),
    (dict(hidden_size=48, num_attention_heads=6, tensor_model_parallel_size=4),
     r"--num-attention-heads \(6\).*--tensor-model-parallel-size \(4\)"),
    (dict(hidden_dropout=1.5), "--hidden-dropout"),
    (dict(fp16=True, bf16=True), "--fp16 and --bf16"),
    (dict(recompute_granularity="full"), "--recompute-method"),
    (dict(seq_length=256, max_position_embeddings=128), "--max-position-embeddings"),
    (dict(position_embedding_type="alibi"), "--position-embedding-type"),
    (dict(num_layers=0), "--num-layers"),
])
def test_model_config_errors_name_the_flag(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig(**kwargs)


def test_model_config_defaults_and_padding():
    c = ModelConfig(hidden_size=64, num_attention_heads=8, vocab_size=50257,
                    tensor_model_parallel_size=8)
    assert c.ffn_hidden_size == 256 and c.kv_channels == 8
    assert c.max_position_embeddings == c.seq_length
    assert c.padded_vocab_size == 51200  # multiple of 128 x 8
    assert ModelConfig(vocab_size=50257).padded_vocab_size == 50304


def test_parallel_config():
    p = ParallelConfig(world_size=128, tensor_model_parallel_size=8, pipeline_model_parallel_size=8)
    assert p.data_parallel_size == 2
    assert not ParallelConfig(world_size=2, sequence_parallel=True).sequence_parallel
    with pytest.raises(ConfigError, match=r"world size \(12\).*\(8\).*\(1\)"):
        ParallelConfig(world_size=12, tensor_model_parallel_size=8)


def test_layer_ranges():
    assert [layer_range([12] * 8, r) for r in range(8)] == [(12 * r, 12) for r in range(8)]
    # interleaved: stage 1 of 4 with 2 chunks holds chunks 1 and 5 of 8
    assert layer_range([4] * 4, 1, virtual_size=2, virtual_rank=0) == (2, 2)
    assert layer_range([4] * 4, 1, virtual_size=2, virtual_rank=1) == (10, 2)
    counts = split_pipeline_layers(10, 4, first=1, last=3)
    assert counts == (1, 3, 3, 3) and layer_range(counts, 2) == (4, 3)
    with pytest.raises(ConfigError, match=r"--num-layers \(10\).*\(4\)"):
        split_pipeline_layers(10, 4)
    with pytest.raises(ConfigError, match="virtual stages"):
        layer_range([3] * 4, 0, virtual_size=2)

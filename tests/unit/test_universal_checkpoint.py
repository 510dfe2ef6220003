"""DeepSpeed universal checkpoints, the parts that need no training run: the parameter names
of each engine read as ours, what our DeepSpeed saves tell ds_to_universal.py, and which
engine reads a universal --load with --deepspeed (tests/distributed/test_universal_checkpoint.py
runs DeepSpeed's own converter and resumes training from its folders)."""

from __future__ import annotations

import re

import pytest

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.formats.deepspeed.universal import (
    expected_shapes,
    full_names,
    universal_checkpoint_info,
)
from megatron.checkpointing.formats.deepspeed.universal_folder import find_universal
from megatron.config import ModelConfig, parse_args
from megatron.integrations.deepspeed import DeepSpeedSetupError, build_deepspeed_config
from megatron.model.names import tp_split_dim

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                    max_position_embeddings=32, vocab_size=127, make_vocab_size_divisible_by=64,
                    tensor_model_parallel_size=2)
LAYER = ["input_layernorm.weight", "self_attention.query_key_value.weight",
         "self_attention.dense.weight", "mlp.dense_4h_to_h.bias"]


def test_each_engines_names_are_read_as_ours():
    ours = ["embedding.word_embeddings.weight", "encoder.layers.1.mlp.dense_4h_to_h.bias",
            "final_layernorm.weight"]
    assert full_names(ours, "x") == {n: n for n in ours}
    # Our pipeline module: the tied embedding, layer specs 1..L holding one layer each.
    pipe = ["tied_modules.embed.word_embeddings.weight", "3.final_layernorm.bias",
            *[f"{i}.layers.0.{p}" for i in (1, 2) for p in LAYER]]
    got = full_names(pipe, "x")
    assert got["encoder.layers.1.self_attention.dense.weight"] == \
        "2.layers.0.self_attention.dense.weight"
    assert got["final_layernorm.bias"] == "3.final_layernorm.bias"
    assert got["embedding.word_embeddings.weight"] == pipe[0]
    # Megatron-DeepSpeed's GPTModelPipe: spec 0 is a function (no parameters), layers hold
    # their entries bare, the final norm is weight/bias, an untied head lm_head.
    mds_pipe = ["1.word_embeddings.weight", *[f"{i}.{p}" for i in (2, 3) for p in LAYER],
                "4.weight", "4.bias", "5.lm_head.weight"]
    got = full_names(mds_pipe, "x")
    assert got["embedding.word_embeddings.weight"] == "1.word_embeddings.weight"
    assert got["encoder.layers.0.input_layernorm.weight"] == "2.input_layernorm.weight"
    assert got["encoder.layers.1.self_attention.dense.weight"] == "3.self_attention.dense.weight"
    assert (got["final_layernorm.weight"], got["output_layer.weight"]) == \
        ("4.weight", "5.lm_head.weight")
    # Megatron-DeepSpeed's plain model.
    mds = ["language_model.embedding.word_embeddings.weight",
           "language_model.encoder.layers.0.self_attention.dense.weight",
           "language_model.encoder.final_layernorm.bias", "language_model.output_layer.weight"]
    assert set(full_names(mds, "x")) == {"embedding.word_embeddings.weight",
                                        "encoder.layers.0.self_attention.dense.weight",
                                        "final_layernorm.bias", "output_layer.weight"}
    with pytest.raises(CheckpointError, match=r"where: pipeline layer 7 "
                       r"\(7.unknown.weight\) is not one of GPT's layers"):
        full_names(["7.unknown.weight", "tied_modules.embed.x"], "where")


@pytest.mark.parametrize("pipeline", [False, True])
def test_universal_checkpoint_info_follows_the_tensor_parallel_rule(pipeline):
    """Every parameter of the model matches the patterns of the way placement.py cuts it
    (ds_to_universal.py asserts at most one match per kind, and uses every pattern)."""
    info = universal_checkpoint_info(MODEL, pipeline)
    assert (info["original_vocab_size"], info["padded_vocab_size"]) == (127, 128)
    kinds = {None: "tp_replicated_parameter_patterns",
             1: "parameter_with_row_parallelism_patterns"}
    used = set()
    for full in expected_shapes(MODEL):
        name = full
        if pipeline:
            name = full.replace("embedding.", "tied_modules.embed.").replace(
                "encoder.layers.1.", "2.layers.0.").replace("encoder.layers.0.", "1.layers.0.")
            name = "3." + name if name.startswith("final_layernorm") else name
        for dim, kind in kinds.items():
            hits = [p for p in info[kind] if re.match(p, name)]
            assert len(hits) == (tp_split_dim(full) == dim), (name, kind, hits)
            used.update(hits)
        vocab = [p for p in info["vocabulary_parameter_patterns"] if re.match(p, name)]
        assert len(vocab) == (full == "embedding.word_embeddings.weight")
        used.update(vocab)
        tied = [p for p in info["pipeline_replicated_parameter_patterns"] if re.match(p, name)]
        assert bool(tied) == (pipeline and full.startswith("embedding."))
    assert used == {p for k in (*kinds.values(), "vocabulary_parameter_patterns")
                    for p in info[k]}


def _universal(tmp_path):
    folder = tmp_path / "save" / "global_step3_universal"
    (folder / "zero").mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "save" / "latest_universal").write_text(folder.name)
    return tmp_path / "save"


def _ds(*flags: str) -> dict:
    base = ("--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 100 --deepspeed "
            "--no-pipeline-parallel").split()
    return build_deepspeed_config(parse_args([*base, *flags], world_size=2))


def test_which_engine_reads_a_universal_load(tmp_path):
    """As Megatron-DeepSpeed's flag does, DeepSpeed's engine is told to read the universal
    checkpoint (checkpoint.load_universal) where its optimizer restores the state (ZeRO 1/2);
    at stage 0 (our bare optimizer) or weights only, ours loads it; ZeRO-3 is refused."""
    save = str(_universal(tmp_path))
    flag = ["--load", save, "--universal-checkpoint"]
    assert _ds("--zero-stage", "1", *flag)["checkpoint"] == {"load_universal": True}
    assert _ds("--zero-stage", "2", *flag)["checkpoint"]["load_universal"]
    assert "checkpoint" not in _ds("--zero-stage", "0", *flag)
    assert "checkpoint" not in _ds("--zero-stage", "1", *flag, "--no-load-optim")
    # Without the flag the save folder's DeepSpeed checkpoint would be read (none here).
    assert "checkpoint" not in _ds("--zero-stage", "1", "--load", save)
    with pytest.raises(DeepSpeedSetupError, match="universal checkpoint, which DeepSpeed's "
                       "ZeRO-3 engine does not resume exactly.*--zero-stage 1 or 2, or without "
                       "--deepspeed"):
        _ds("--zero-stage", "3", *flag)


def test_universal_flag_needs_a_universal_checkpoint(tmp_path):
    """--universal-checkpoint on a folder without latest_universal, and a folder holding only
    a universal checkpoint loaded without the flag: one line each, saying what to do."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="--universal-checkpoint: --load .*empty holds no "
                       "latest_universal"):
        find_universal(str(empty), True)
    only = tmp_path / "only"
    (only / "u" / "zero").mkdir(parents=True)
    (only / "u" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (only / "latest_universal").write_text("u")
    with pytest.raises(CheckpointError, match="holds only a universal checkpoint .* add "
                       "--universal-checkpoint"):
        find_universal(str(only), False)
    assert find_universal(str(only), True).path == str(only / "u")
    assert find_universal(str(only / "u"), False).path == str(only / "u")


def test_universal_checkpoint_info_of_an_untied_swiglu_pipeline():
    """The Llama family in the pipeline module: SwiGLU's first projection is two parts each
    cut over the ranks ([gate_r; up_r], DeepSpeed's parameter_with_2_sub_params_cat_dim_0),
    the embedding is layer spec 0 (not shared with a stage) and the LM head the last."""
    import dataclasses

    llama = dataclasses.replace(MODEL, normalization="RMSNorm", swiglu=True,
                                ffn_hidden_size=64, untie_embeddings_and_output_weights=True,
                                add_bias_linear=False, position_embedding_type="rope")
    info = universal_checkpoint_info(llama, True)

    def kinds(name: str) -> set[str]:
        return {k for k, patterns in info.items() if isinstance(patterns, list)
                and any(re.match(p, name) for p in patterns)}

    assert kinds("1.layers.0.mlp.dense_h_to_4h.weight") == {
        "parameter_with_2_sub_params_cat_dim_0"}
    assert kinds("2.layers.0.mlp.dense_4h_to_h.weight") == {
        "parameter_with_row_parallelism_patterns"}
    assert kinds("0.word_embeddings.weight") == {"vocabulary_parameter_patterns"}
    assert kinds("4.lm_head.weight") == {"vocabulary_parameter_patterns"}
    assert info["pipeline_replicated_parameter_patterns"] == []

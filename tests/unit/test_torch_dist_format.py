"""The pieces of the torch_dist format that need no process group: boxes of flat ranges,
megatron-core's names and layouts, Megatron-LM's args, common.pt's unknown classes, DCP
pieces read back clipped, and the errors for folders that do not fit."""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import random
import re

import pytest
import torch

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.formats.torch_dist import checkpoint as torch_dist
from megatron.checkpointing.formats.torch_dist import dcp
from megatron.checkpointing.formats.torch_dist.mcore_layout import place
from megatron.checkpointing.run_config import model_fields_from_args
from megatron.config import ModelConfig


def test_flat_ranges_become_boxes_that_are_their_elements_in_order():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        full = torch.arange(n).view(shape)
        flat = full.reshape(-1)[lo:hi]
        covered = 0
        for offset, sizes, first in dcp.flat_boxes(shape, lo, hi):
            box = full[tuple(slice(o, o + s) for o, s in zip(offset, sizes))]
            assert torch.equal(box.reshape(-1), flat[first - lo:first - lo + box.numel()])
            covered += box.numel()
        assert covered == hi - lo
        assert len(dcp.flat_boxes(shape, lo, hi)) <= 2 * len(shape) + 1


def test_our_parameters_sit_in_megatron_core_global_tensors():
    qkv = place("encoder.layers.1.self_attention.query_key_value.weight", (48, 32), 5, 8, 1, 2)
    assert (qkv.key, qkv.global_shape, qkv.offset, qkv.stacked, qkv.writer) == (
        "decoder.layers.self_attention.linear_qkv.weight", (8, 96, 32), (5, 48, 0), True, True)
    proj = place("encoder.layers.0.self_attention.dense.weight", (32, 16), 2, 8, 1, 2)
    assert (proj.key, proj.global_shape, proj.offset) == (
        "decoder.layers.self_attention.linear_proj.weight", (8, 32, 32), (2, 0, 16))
    ln = place("encoder.layers.0.post_attention_layernorm.bias", (32,), 3, 8, 1, 2)
    assert (ln.key, ln.offset, ln.writer) == ("decoder.layers.mlp.linear_fc1.layer_norm_bias",
                                              (3, 0), False)  # tp rank 0 writes replicas
    tied = place("word_embeddings.weight", (64, 32), None, 8, 1, 2)
    assert (tied.key, tied.global_shape, tied.offset, tied.writer) == (
        "embedding.word_embeddings.weight", (128, 32), (64, 0), False)
    final = place("final_layernorm.weight", (32,), None, 8, 0, 2)
    assert (final.key, final.stacked, final.writer) == ("decoder.final_layernorm.weight",
                                                        False, True)
    assert qkv.box((3, 4), (2, 5)) == ((5, 51, 4), (1, 2, 5))
    with pytest.raises(KeyError, match="no megatron-core name"):
        place("encoder.layers.0.mlp.gate.weight", (4,), 0, 8, 0, 1)


def test_experts_sit_along_an_axis_of_their_own_after_the_layers():
    """megatron-core's SequentialMLP layout (tests/distributed/test_torch_dist_moe.py reads
    and writes it against megatron-core): an expert axis after the layer axis, or, where
    --moe-layer-freq makes the layers differ, one unstacked name per layer."""
    from megatron.checkpointing.formats.torch_dist.mcore_layout import layer_extra_state_keys
    from megatron.model.mcore_names import mcore_layout

    moe = dict(num_layers=4, hidden_size=8, num_attention_heads=2, seq_length=4,
               vocab_size=16, num_experts=4, ffn_hidden_size=16, moe_ffn_hidden_size=6, swiglu=True,
               add_bias_linear=False, moe_shared_expert_intermediate_size=10)
    every = ModelConfig(**moe)
    fc1 = place("encoder.layers.1.mlp.local_experts.3.dense_h_to_4h.weight", (6, 8), 2, 4, 1, 2,
                2, layout=mcore_layout(every))  # tensor rank 1 of 2: [gate_1; up_1]
    assert (fc1.key, fc1.global_shape, fc1.offset, fc1.lead, fc1.parts) == (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight", (4, 4, 12, 8), (2, 3, 3, 0), 2,
        (3, 6))
    assert fc1.box((3, 0), (3, 8)) == ((2, 3, 9, 0), (1, 1, 3, 8))  # the up rows
    router = place("encoder.layers.0.mlp.router.weight", (4, 8), 3, 4, 1, 2,
                   layout=mcore_layout(every))
    assert (router.key, router.offset, router.writer) == ("decoder.layers.mlp.router.weight",
                                                          (3, 0, 0), False)
    assert layer_extra_state_keys(1, every)[2:4] == [
        "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.0_4.4",
        "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.0_4.4"]
    assert layer_extra_state_keys(1, every)[-1] == \
        "decoder.layers.mlp.shared_experts.linear_fc2._extra_state/shard_1_4"
    alternate = ModelConfig(**moe, moe_layer_freq="[1,0,1,0]")
    fc2 = place("encoder.layers.0.mlp.local_experts.1.dense_4h_to_h.weight", (8, 3), 2, 4, 1, 2,
                layout=mcore_layout(alternate))
    assert (fc2.key, fc2.global_shape, fc2.offset, fc2.lead) == (
        "decoder.layers.2.mlp.experts.experts.linear_fc2.weight", (4, 8, 6), (1, 0, 3), 1)
    norm = place("encoder.layers.0.post_attention_layernorm.weight", (8,), 3, 4, 0, 1,
                 layout=mcore_layout(alternate))  # a dense layer's, unstacked too
    assert (norm.key, norm.global_shape, norm.lead) == (
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", (8,), 0)
    assert layer_extra_state_keys(3, alternate) == [
        f"decoder.layers.3.{m}._extra_state/shard_0_1" for m in (
            "self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
            "mlp.linear_fc2")]


def test_stored_expert_biases_ask_for_their_flag(tmp_path):
    """A checkpoint with loss-free balancing's expert biases is not read into a model
    without them (nothing of them would be read)."""
    key = "decoder.layers.mlp.router.expert_bias"
    dcp.write_pieces(str(tmp_path), [dcp.Piece(key, (2, 4), (0, 0), torch.ones(2, 4))], {})
    config = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                         vocab_size=16, num_experts=4)
    with pytest.raises(CheckpointError, match="expert biases: add "
                       "--moe-router-enable-expert-bias"):
        torch_dist.check_model_keys(dcp.read_metadata(str(tmp_path)), [], config, "CKPT")


def test_megatron_lm_expert_buckets_ask_for_no_load_optim(tmp_path):
    """Megatron-LM's default distributed-optimizer state of a model with experts (its own
    buffers for them) is not laid out here: the load names --no-load-optim and --finetune."""
    from megatron.checkpointing.formats.torch_dist import mcore_buckets

    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, " \
             "torch.float32).bucket_idx_0.exp_avg"
    dcp.write_pieces(str(tmp_path), [dcp.Piece(bucket, (40,), (0,), torch.zeros(40))], {})
    config = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                         vocab_size=16, num_experts=4)
    with pytest.raises(CheckpointError) as error:
        mcore_buckets.bucket_layout(dcp.read_metadata(str(tmp_path)), {"args": None},
                                    config, "CKPT")
    message = str(error.value)
    assert "\n" not in message and "--num-experts 4" in message
    assert "--no-load-optim" in message and "--finetune" in message


@pytest.mark.parametrize("args, activation", [
    ({}, "gelu"),
    ({"bias_gelu_fusion": True}, "gelu_tanh"),  # Megatron's default: the fused tanh form
    ({"bias_gelu_fusion": True, "add_bias_linear": False}, "gelu"),  # no bias, no fusion
    ({"openai_gelu": True}, "gelu_tanh"),
])
def test_megatron_gelu_settings_map_to_our_activation(args, activation):
    fields = model_fields_from_args({"num_layers": 2, "norm_epsilon": 1e-6, **args})
    assert fields["activation"] == activation and fields["layernorm_epsilon"] == 1e-6


@pytest.mark.parametrize("args, named", [
    ({"num_experts": [8]}, "--num-experts"),  # Megatron-DeepSpeed's list: DeepSpeed-MoE
    ({"qk_layernorm": True}, "--qk-layernorm"),
    ({"num_experts": 4, "moe_router_num_groups": 2}, "--moe-router-num-groups"),
    ({"num_experts": 4, "moe_router_topk_scaling_factor": 2.5},
     "--moe-router-topk-scaling-factor"),
    ({"num_experts": 4, "moe_aux_loss_coeff": [0.01, 0.001]}, r"\[0.01, 0.001\]"),
])
def test_megatron_models_we_cannot_compute_are_refused_by_name(args, named):
    with pytest.raises(ValueError, match=named):
        model_fields_from_args(args)


def test_megatron_lm_moe_args_map_to_our_fields():
    """megatron-core's MoE settings as Megatron-LM's args keep them (its --moe-layer-freq an
    int or the evaluated list, some settings one per loss kind) read as our flags'."""
    fields = model_fields_from_args({
        "num_layers": 4, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 24,
        "moe_layer_freq": [1, 0, 1, 0], "moe_shared_expert_intermediate_size": 16,
        "moe_shared_expert_gate": True, "moe_router_load_balancing_type": ["seq_aux_loss"],
        "moe_aux_loss_coeff": [0.02], "moe_z_loss_coeff": 1e-3,
        "moe_router_score_function": "sigmoid", "moe_token_dispatcher_type": "flex",
        "moe_router_pre_softmax": False, "moe_grouped_gemm": True,
        "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01})
    assert {k: v for k, v in fields.items() if "moe" in k or "expert" in k} == {
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 24,
        "moe_layer_freq": "[1,0,1,0]", "moe_shared_expert_intermediate_size": 16,
        "moe_shared_expert_gate": True, "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 0.02, "moe_z_loss_coeff": 1e-3,
        "moe_router_score_function": "sigmoid", "moe_token_dispatcher_type": "alltoall",
        "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01}
    config = ModelConfig(**{**fields, "hidden_size": 16, "num_attention_heads": 2,
                            "seq_length": 8, "vocab_size": 30})
    assert config.moe_layers == (True, False, True, False)
    assert model_fields_from_args({"num_experts": 1, "moe_layer_freq": 1}).get(
        "num_experts") is None  # dense


LLAMA = {"swiglu": True, "num_attention_heads": 8, "add_bias_linear": False,
         "untie_embeddings_and_output_weights": True}


@pytest.mark.parametrize("args", [
    # Megatron-LM's Llama flags
    {**LLAMA, "normalization": "RMSNorm", "group_query_attention": True, "num_query_groups": 2,
     "position_embedding_type": "rope", "rotary_base": 500000},
    # Megatron-DeepSpeed's (pretrain_llama2_distributed.sh)
    {**LLAMA, "normalization": "rmsnorm", "num_key_value_heads": 2,
     "use_rotary_position_embeddings": True, "rope_theta": 500000},
])
def test_megatron_llama_settings_map_to_our_fields(args):
    fields = model_fields_from_args(args)
    assert {k: fields.get(k) for k in ("normalization", "swiglu", "group_query_attention",
                                       "num_query_groups", "position_embedding_type",
                                       "rotary_base", "add_bias_linear")} == {
        "normalization": "RMSNorm", "swiglu": True, "group_query_attention": True,
        "num_query_groups": 2, "position_embedding_type": "rope", "rotary_base": 500000,
        "add_bias_linear": False}
    # Megatron-LM keeps --num-query-groups 1 without --group-query-attention: not MQA.
    plain = model_fields_from_args({"num_attention_heads": 8, "num_query_groups": 1})
    assert "num_query_groups" not in plain


def test_our_llama_args_read_back_as_the_same_model():
    """common.pt's args are what Megatron-LM's --use-checkpoint-args builds its model from:
    a Llama-option model of ours reads back with every option it was trained with."""
    from megatron.checkpointing.ranks import RankLayout
    from megatron.config import parse_args

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr",
            "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "126",
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
            "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type",
            "rope", "--rotary-base", "500000", "--rotary-interleaved", "--use-rope-scaling",
            "--rope-scaling-factor", "4", "--add-qkv-bias", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights"]
    cfg = parse_args(argv, world_size=1)
    args = torch_dist.megatron_args(cfg, RankLayout(), 3, (6, 0))
    fields = model_fields_from_args(vars(args))
    names = ("normalization", "layernorm_epsilon", "swiglu", "group_query_attention",
             "num_query_groups", "ffn_hidden_size", "position_embedding_type", "rotary_base",
             "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor", "add_qkv_bias",
             "add_bias_linear", "untie_embeddings_and_output_weights")
    assert {k: fields.get(k) for k in names} == {k: getattr(cfg.model, k) for k in names}


class _TheirEnum(enum.Enum):  # stands for a megatron-core enum in Megatron-LM's args
    auto = 5


def test_common_pt_reads_unknown_classes_as_opaque_values(tmp_path):
    args = argparse.Namespace(num_layers=2, attention_backend=_TheirEnum.auto,
                              params_dtype=torch.bfloat16)
    torch.save({"args": args, "iteration": 3}, tmp_path / "common.pt")
    common = torch_dist.read_common(str(tmp_path))
    assert common["iteration"] == 3 and common["args"].params_dtype == torch.bfloat16
    assert isinstance(common["args"].attention_backend, torch_dist.OpaqueValue)
    assert common["args"].attention_backend.args == (5,)
    (tmp_path / "common.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="common.pt"):
        torch_dist.read_common(str(tmp_path))


def test_a_folder_is_torch_dist_by_its_metadata_json(tmp_path):
    assert not torch_dist.is_torch_dist(str(tmp_path))
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert torch_dist.is_torch_dist(str(tmp_path))
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match="'zarr' backend; only torch_dist"):
        torch_dist.is_torch_dist(str(tmp_path))


def test_pieces_read_back_clipped_to_the_stored_extent(tmp_path):
    full = torch.randn(3, 6, 4)
    pieces = [dcp.Piece("w", (3, 6, 4), off, full[tuple(slice(o, o + s) for o, s in
                                                        zip(off, sizes))].clone())
              for off, sizes, _ in dcp.flat_boxes((3, 6, 4), 5, 72)]
    pieces.append(dcp.Piece("w", (3, 6, 4), (0, 0, 0), full[:1, :1, :1].clone()))
    rows = torch.arange(10.0).view(5, 2)
    pieces.append(dcp.Piece("vocab", (5, 2), (0, 0), rows))
    digests = dcp.write_pieces(str(tmp_path), pieces[:-2] + pieces[-1:], {"obj": b"x"})
    assert sorted(digests) == sorted(os.listdir(tmp_path))  # every file, as written
    box = torch.zeros(2, 3, 4)
    more_rows = torch.full((8, 2), -1.0)  # padded further than the stored vocabulary
    objects = dcp.read_pieces(str(tmp_path), [dcp.Piece("w", (3, 6, 4), (1, 2, 0), box),
                                              dcp.Piece("vocab", (8, 2), (0, 0), more_rows)],
                              ["obj"])
    assert objects == {"obj": b"x"}
    assert torch.equal(box[:1], full[1:2, 2:5]) and torch.equal(box[1], full[2, 2:5])
    assert torch.equal(more_rows[:5], rows) and (more_rows[5:] == -1).all()


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    config = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                         vocab_size=30, make_vocab_size_divisible_by=8,
                         untie_embeddings_and_output_weights=True)
    dcp.write_pieces(str(tmp_path), [
        dcp.Piece("embedding.word_embeddings.weight", (24, 8), (0, 0), torch.zeros(24, 8)),
        dcp.Piece("decoder.final_layernorm.weight", (9,), (0,), torch.zeros(9))], {})
    metadata = dcp.read_metadata(str(tmp_path))
    wanted = [place(n, s, None, 2, 0, 1) for n, s in (
        ("embedding.word_embeddings.weight", (32, 8)), ("final_layernorm.weight", (8,)),
        ("output_layer.weight", (32, 8)))]
    with pytest.raises(CheckpointError) as info:
        torch_dist.check_model_keys(metadata, wanted, config, "CKPT")
    message = str(info.value)
    assert "'embedding.word_embeddings.weight' has shape [24, 8], this model needs [>= 30, 8]" \
        in message
    assert "'decoder.final_layernorm.weight' has shape [9], this model's is [8]" in message
    assert "no tensor 'output_layer.weight': it was saved with tied embeddings" in message


def test_megatron_lm_buckets_that_do_not_fit_the_model_ask_for_no_load_optim(tmp_path):
    """Buckets (Megatron-LM's default distributed-optimizer format) whose lengths do not
    hold this model's parameters as megatron-core lays them out are refused, naming the
    way on; tests/distributed/test_torch_dist.py reads real ones."""
    from megatron.checkpointing.formats.torch_dist import optim
    from megatron.checkpointing.formats.torch_dist.mcore_layout import chunk_places
    from megatron.config import OptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.model.gpt_model import GPTModel

    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4,
                         vocab_size=16, make_vocab_size_divisible_by=8)
    model = GPTModel(config)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model])
    places = {(0, n): (p, pl) for n, p, pl in chunk_places(model, 1, 0, 1)}
    # What Megatron-LM's default distributed-optimizer format stores: flat buckets.
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, " \
             "torch.float32).bucket_idx_0.exp_avg"
    dcp.write_pieces(str(tmp_path), [dcp.Piece(bucket, (40,), (0,), torch.zeros(40))], {})
    common = {"args": argparse.Namespace(), "content_metadata": {
        "distrib_optim_sharding_type": "dp_reshardable"}}
    with pytest.raises(CheckpointError, match="dp_reshardable buckets.*do not hold this "
                       "model's parameters.*--no-load-optim"):
        optim.optimizer_requests(optimizer, [model], places, dcp.read_metadata(str(tmp_path)),
                                 common, "CKPT", config)


@pytest.mark.parametrize("extra, world_size, named", [
    (["--dp-mode", "decentralized"], 2, "--dp-mode decentralized cannot be combined with "
     "--ckpt-format torch_dist"),
    (["--deepspeed", "--zero-stage", "1"], 1, "--ckpt-format torch_dist: DeepSpeed's engine"),
])
def test_torch_dist_is_refused_where_another_writer_saves(extra, world_size, named):
    from megatron.config import ConfigError, parse_args

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "4", "--micro-batch-size", "1", "--train-iters", "2", "--mock-data",
            "--lr", "1e-3", "--ckpt-format", "torch_dist"]
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_args(base + extra, world_size=world_size)


@pytest.mark.parametrize("overlap, pp, untied, sharding, warned", [
    (True, 1, False, "fully_reshardable", True),
    (False, 2, False, "fully_reshardable", True),  # tied embeddings get a bucket of their own
    (False, 2, True, "fully_reshardable", False),
    (False, 1, False, "fully_reshardable", False),  # one bucket per rank: nothing to shift
    (True, 1, False, "dp_reshardable", False),  # read from the buckets themselves
])
def test_megatron_lms_fully_reshardable_state_from_several_buckets_is_warned_of(
        overlap, pp, untied, sharding, warned):
    from megatron.checkpointing.formats.torch_dist.mcore_buckets import shifted_model_space_state

    args = argparse.Namespace(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                              pipeline_model_parallel_size=pp,
                              untie_embeddings_and_output_weights=untied)
    common = {"args": args, "content_metadata": {"distrib_optim_sharding_type": sharding}}
    why = shifted_model_space_state(common)
    assert (why is not None) == warned
    if warned:
        assert "shifted" in why and "--no-load-optim" in why


@pytest.mark.parametrize("tp", [2, 4])
def test_swiglu_pieces_lay_out_gate_then_up_as_megatron_core_does(tp):
    """Each tensor rank holds [gate_r; up_r] (names.tp_parts); megatron-core's SwiGLU factory
    (mlp.apply_swiglu_sharded_factory) stores the global [gate; up] with rank r's gate rows at
    r*f/tp and its up rows at f + r*f/tp. Our pieces of every rank, the model's and a
    distributed-optimizer shard's flat ranges across the gate/up boundary alike, assemble into
    exactly that tensor."""
    from megatron.checkpointing.formats.torch_dist import optim
    from megatron.checkpointing.formats.torch_dist.mcore_layout import local_views
    from megatron.model.sharding import split_tp

    name, f, h = "encoder.layers.0.mlp.dense_h_to_4h.weight", 8, 3
    full = torch.arange(2 * f * h, dtype=torch.float32).reshape(2 * f, h)  # [gate; up]
    model, state = torch.zeros(1, 2 * f, h), torch.zeros(1, 2 * f, h)
    for r, local in enumerate(split_tp(name, full, tp, parts=2)):
        where = place(name, tuple(local.shape), 0, 1, r, tp, parts=2)
        assert where.key == "decoder.layers.mlp.linear_fc1.weight"
        assert where.global_shape == (1, 2 * f, h)
        for offset, view in local_views(where, local):
            model[tuple(slice(o, o + s) for o, s in zip(offset, view.shape))] = view
        n = local.numel()
        for lo, hi in ((0, n // 3), (n // 3, n - 1), (n - 1, n)):  # shards crossing the parts
            for offset, box in optim.boxes(where, tuple(local.shape), local.reshape(-1)[lo:hi],
                                           lo, hi):
                state[tuple(slice(o, o + s) for o, s in zip(offset, box.shape))] = box
    assert torch.equal(model[0], full) and torch.equal(state[0], full)

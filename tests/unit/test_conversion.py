"""megatron/conversion in one process: names, orders and layouts against the real model and
optimizer, interleaved (virtual pipeline) round trips, and Megatron-DeepSpeed's layout."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron.checkpointing import read_manifest
from megatron.checkpointing.formats.torch import cut as cut_module
from megatron.checkpointing.formats.torch import whole as whole_module
from megatron.checkpointing.full_state import repad_vocab
from megatron.checkpointing.run_config import with_layout
from megatron.config import ModelConfig, OptimizerConfig, to_dict
from megatron.conversion import FullCheckpoint, load_full_checkpoint, save_full_checkpoint
from megatron.core.optimizer import get_megatron_optimizer
from megatron.model.gpt_model import GPTModel
from megatron.model.placement import Chunk, pipeline_chunks
from megatron.model.sharding import chunks_from_layer_counts, full_to_chunk_names, split_tp
from tools.checkpoint import convert


def _config(**overrides) -> ModelConfig:
    fields = dict(num_layers=6, hidden_size=16, num_attention_heads=4, seq_length=8,
                  vocab_size=50, make_vocab_size_divisible_by=4, hidden_dropout=0.0,
                  attention_dropout=0.0)
    fields.update(overrides)
    return ModelConfig(**fields)


def _full(config: ModelConfig, with_optimizer: bool = True) -> FullCheckpoint:
    torch.manual_seed(0)
    model = {k: torch.randn(v.shape) for k, v in GPTModel(config).state_dict().items()}
    optimizer = None
    if with_optimizer:
        optimizer = {"param_groups": [{"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0},
                                      {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0}],
                     "step": 7.0, "grad_scaler": None,
                     "param_state": {k: {"exp_avg": torch.randn(v.shape),
                                         "exp_avg_sq": torch.rand(v.shape)}
                                     for k, v in model.items()}}
    cfg = with_layout({"model": to_dict(config), "optimizer": {}}, 1, 1)
    return FullCheckpoint(config=cfg, model=model, optimizer=optimizer, iteration=12,
                          consumed_train_samples=96, scheduler={"num_steps": 96},
                          extra={"num_floating_point_operations_so_far": 5.0})


@pytest.mark.parametrize("untie", [False, True])
@pytest.mark.parametrize("pre,post", [(True, True), (True, False), (False, True), (False, False)])
def test_chunk_names_follow_gpt_model_order(pre, post, untie):
    config = _config(untie_embeddings_and_output_weights=untie)
    full = GPTModel(config).state_dict()
    stage = GPTModel(config, pre_process=pre, post_process=post, first_layer=2, num_layers=2)
    chunk = Chunk(0, 0, 2, 2, pre, post)
    names = full_to_chunk_names(full, chunk, tied=not untie)
    assert list(names) == [n for n, _ in stage.named_parameters()]
    stage.load_state_dict(names)  # shapes fit too


def _stepped_optimizer(config: ModelConfig, seed: int):
    """Two chunks (a pipeline stage's interleaved pieces) and their real optimizer after one
    step with random gradients."""
    torch.manual_seed(seed)
    chunks = [GPTModel(config, post_process=False, num_layers=2),
              GPTModel(config, pre_process=False, first_layer=2, num_layers=2)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, weight_decay=0.1, bf16=config.bf16), chunks)
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = torch.randn_like(p)
    optimizer._copy_model_grads_to_main_grads()
    optimizer.optimizer.step()
    return chunks, optimizer


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed"])
def test_torch_optimizer_state_by_name_round_trip(bf16):
    """A real optimizer's state read by name is each parameter's own (the indices follow
    get_param_groups), and written back it loads into a fresh optimizer as it was; with bf16,
    the fp32 main copies too."""
    config = _config(num_layers=4, bf16=bf16)
    chunks, optimizer = _stepped_optimizer(config, 0)
    states = [c.state_dict() for c in chunks]
    per_chunk, meta = whole_module.named_torch_state(optimizer.state_dict(), states, "test")
    assert meta["step"] == 1.0 and [g["wd_mult"] for g in meta["param_groups"]] == [1.0, 0.0]
    mains = dict(zip((p for g in optimizer.model_groups for p in g),
                     (m for g in optimizer.main_groups for m in g))) if bf16 else {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            main = mains.get(p, p)
            assert torch.equal(per_chunk[i][name]["exp_avg"],
                               optimizer.optimizer.state[main]["exp_avg"]), name
            if bf16:
                assert torch.equal(per_chunk[i][name]["param"], main), name
    rebuilt = cut_module.torch_optimizer(meta, states, per_chunk, mixed=bf16)
    _, fresh = _stepped_optimizer(config, 1)
    fresh.load_state_dict(rebuilt)
    want, got = optimizer.state_dict(), fresh.state_dict()
    torch_want, torch_got = (want["optimizer"], got["optimizer"]) if bf16 else (want, got)
    for index, entry in torch_want["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch_got["state"][index][key], value), (index, key)
    if bf16:
        for saved, loaded in zip(want["fp32_from_fp16_params"], got["fp32_from_fp16_params"]):
            assert all(torch.equal(a, b) for a, b in zip(saved, loaded))


@pytest.mark.parametrize("distributed", [False, True])
def test_interleaved_round_trip(tmp_path, distributed):
    """Full -> tp 2 x pp 3 with 2 chunks per stage -> full gives back every tensor; chunk 1
    of stage 0 holds global layer 3 (Megatron's interleaving)."""
    config = _config()
    full = _full(config)
    folder = save_full_checkpoint(full, str(tmp_path / "vp"), 2, 3,
                                  num_layers_per_virtual_pipeline_stage=1,
                                  use_distributed_optimizer=distributed)
    manifest = read_manifest(folder)
    assert manifest["parallel_layout"]["num_model_chunks"] == 2
    assert manifest["config"]["parallel"]["virtual_pipeline_model_parallel_size"] == 2
    rank0 = torch.load(os.path.join(folder, "mp_rank_00_000", "model_optim_rng.pt"),
                       weights_only=True)
    qkv = "encoder.layers.{}.self_attention.query_key_value.weight"
    want = split_tp(qkv.format(3), full.model[qkv.format(3)], 2)[0]
    assert torch.equal(rank0["model1"][qkv.format(0)], want)
    assert (("optimizer" in rank0) != distributed) and ("rng_state" not in rank0)
    back = load_full_checkpoint(str(tmp_path / "vp"))
    assert back.distributed_optimizer == distributed
    assert (back.iteration, back.consumed_train_samples, back.scheduler, back.extra) == (
        12, 96, {"num_steps": 96}, {"num_floating_point_operations_so_far": 5.0})
    assert back.model.keys() == full.model.keys()
    for name, value in full.model.items():
        assert torch.equal(back.model[name], value), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.optimizer["param_state"][name][key],
                               full.optimizer["param_state"][name][key]), (name, key)
    assert back.optimizer["step"] == 7.0


def _megatron_deepspeed_model(chunk: dict) -> dict:
    """Our chunk names in Megatron-DeepSpeed's nested ``language_model`` layout."""
    lm: dict = {"embedding": {}, "encoder": {}}
    out: dict = {"language_model": lm}
    for name, value in chunk.items():
        if name.startswith("embedding."):
            table = name.split(".")[1]
            lm["embedding"][table] = {"weight": value}
        elif name == "word_embeddings.weight":
            out["word_embeddings_for_head"] = {"weight": value}
        else:
            lm["encoder"][name.removeprefix("encoder.")] = value  # layers.*, final_layernorm.*
    return out


def test_megatron_deepspeed_layout_converts(tmp_path):
    """A Megatron-DeepSpeed checkpoint at tp 2 x pp 2 (written here from a known model by
    renaming keys, with its flags as an argparse Namespace) converts to ours."""
    config = _config(num_layers=4)
    full = _full(config, with_optimizer=False)
    ours = save_full_checkpoint(full, str(tmp_path / "ours"), 2, 2)
    theirs = tmp_path / "mds"
    args = argparse.Namespace(num_layers=4, hidden_size=16, num_attention_heads=4,
                              ffn_hidden_size=64, seq_length=8, max_position_embeddings=8,
                              make_vocab_size_divisible_by=4, padded_vocab_size=56,
                              tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              consumed_train_samples=96, tokenizer_type="GPT2BPETokenizer")
    for rank_dir in sorted(os.listdir(ours)):
        if not rank_dir.startswith("mp_rank"):
            continue
        state = torch.load(os.path.join(ours, rank_dir, "model_optim_rng.pt"), weights_only=True)
        os.makedirs(theirs / "iter_0000012" / rank_dir)
        torch.save({"checkpoint_version": 3.0, "iteration": 12, "args": args,
                    "model": _megatron_deepspeed_model(state["model"])},
                   theirs / "iter_0000012" / rank_dir / "model_optim_rng.pt")
    (theirs / "latest_checkpointed_iteration.txt").write_text("12")
    save = tmp_path / "converted"
    assert convert.main(["--model-type", "GPT", "--loader", "megatron_deepspeed",
                         "--load-dir", str(theirs), "--save-dir", str(save),
                         "--true-vocab-size", "50"]) == 0
    back = load_full_checkpoint(str(save))
    assert back.optimizer is None and back.consumed_train_samples == 96
    assert back.model_config().vocab_size == 50
    for name, value in full.model.items():
        assert torch.equal(back.model[name], value), name


def _deepspeed_layer_files(pieces: dict, num_layers: int, tied: bool) -> list[tuple[str, dict]]:
    """A tensor rank's PipelineModule layer files as Megatron-DeepSpeed's GPTModelPipe lays
    them out: 0 embedding, 1 a function, 2.. transformer layers, then a function, the final
    layer norm, and the tied embedding again as the LM head."""
    embedding = {k.removeprefix("embedding."): v for k, v in pieces.items()
                 if k.startswith("embedding.")}
    files = [(0, embedding)]
    for i in range(num_layers):
        prefix = f"encoder.layers.{i}."
        files.append((2 + i, {k.removeprefix(prefix): v for k, v in pieces.items()
                              if k.startswith(prefix)}))
    final = {k.removeprefix("final_layernorm."): v for k, v in pieces.items()
             if k.startswith("final_layernorm.")}
    files.append((num_layers + 3, final))
    files.append((num_layers + 4, embedding if tied else {"weight": pieces["output_layer.weight"]}))
    return [(f"layer_{i:02d}", state) for i, state in files]


@pytest.mark.parametrize("pipeline,untie,tp", [(False, False, 2), (True, False, 2),
                                               (True, True, 1)],
                         ids=["module", "pipeline-layers-tied", "pipeline-layers-untied-tp1"])
def test_deepspeed_layout_converts(tmp_path, pipeline, untie, tp):
    """A DeepSpeed engine checkpoint (written here in DeepSpeed's file layout from a
    known model), with the model in mp_rank_XX_model_states.pt or in PipelineModule layer
    files, converts to ours."""
    config = _config(num_layers=4, untie_embeddings_and_output_weights=untie)
    full = _full(config, with_optimizer=False)
    step = tmp_path / "ds" / "global_step12"
    step.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step12")
    padded = repad_vocab(full.model, full.model_config(tp).padded_vocab_size)
    for t in range(tp):
        pieces = {k: split_tp(k, v, tp)[t] for k, v in padded.items()}
        client = {"module": None if pipeline else pieces, "iteration": 12, "global_steps": 12,
                  "global_samples": 96, "config": full.config, "dp_world_size": 1}
        torch.save(client, step / f"mp_rank_{t:02d}_model_states.pt")
        if pipeline:
            for name, state in _deepspeed_layer_files(pieces, 4, tied=not untie):
                rank = f"-model_{t:02d}" if tp > 1 else ""  # no model axis: no rank
                torch.save(state, step / f"{name}{rank}-model_states.pt")
    save = tmp_path / "converted"
    assert convert.main(["--model-type", "GPT", "--loader", "deepspeed", "--load-dir",
                         str(tmp_path / "ds"), "--save-dir", str(save)]) == 0
    back = load_full_checkpoint(str(save))
    assert (back.iteration, back.consumed_train_samples) == (12, 96)
    assert back.model.keys() == full.model.keys()
    for name, value in full.model.items():
        assert torch.equal(back.model[name], value), name


def test_megatron_deepspeeds_own_llama_checkpoint_converts(tmp_path):
    """A Llama model as Megatron-DeepSpeed's hf2megads_weight_converter.py saves it (its
    GPTModelPipe's layer files at tp 2: the embedding at spec 1, layers from 2, the RMSNorm
    weight alone at L + 2, ``lm_head.weight`` at L + 3; per rank [gate_r; up_r]; its flags as
    an argparse Namespace in the client state) converts to ours with its settings."""
    from megatron.model.names import tp_parts

    config = _config(num_layers=2, normalization="RMSNorm", swiglu=True, ffn_hidden_size=32,
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                     add_bias_linear=False)
    full = _full(config, with_optimizer=False)
    args = argparse.Namespace(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
        ffn_hidden_size=32, seq_length=8, max_position_embeddings=8, padded_vocab_size=56,
        make_vocab_size_divisible_by=4, swiglu=True, normalization="rmsnorm",
        use_rotary_position_embeddings=True, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    step = tmp_path / "mds" / "global_step5"
    step.mkdir(parents=True)
    (tmp_path / "mds" / "latest").write_text("global_step5")
    padded = repad_vocab(full.model, full.model_config(2).padded_vocab_size)
    for t in range(2):
        pieces = {k: split_tp(k, v, 2, tp_parts(k, config))[t] for k, v in padded.items()}
        torch.save({"module": None, "iteration": 5, "global_steps": 5, "args": args},
                   step / f"mp_rank_{t:02d}_model_states.pt")
        files = {1: {"word_embeddings.weight": pieces["embedding.word_embeddings.weight"]},
                 4: {"weight": pieces["final_layernorm.weight"]},
                 5: {"lm_head.weight": pieces["output_layer.weight"]}}
        for i in range(2):
            prefix = f"encoder.layers.{i}."
            files[2 + i] = {k.removeprefix(prefix): v for k, v in pieces.items()
                            if k.startswith(prefix)}
        for i, state in files.items():
            torch.save(state, step / f"layer_{i:02d}-model_{t:02d}-model_states.pt")
    save = tmp_path / "converted"
    assert convert.main(["--model-type", "GPT", "--loader", "deepspeed", "--load-dir",
                         str(tmp_path / "mds"), "--save-dir", str(save),
                         "--true-vocab-size", "50"]) == 0
    back = load_full_checkpoint(str(save))
    m = back.model_config()
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.add_bias_linear,
            m.untie_embeddings_and_output_weights) == ("RMSNorm", True, "rope", False, True)
    assert back.model.keys() == full.model.keys()
    for name, value in full.model.items():
        assert torch.equal(back.model[name], value), name


def test_zero3_checkpoint_at_tensor_parallel_2_is_refused(tmp_path, capsys):
    """ZeRO-3 keeps only placeholders in its model files; DeepSpeed's gatherer reads tensor
    rank 0 alone, so a tp 2 ZeRO-3 checkpoint is refused, saying why."""
    config = _config()
    step = tmp_path / "ds" / "global_step2"
    step.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step2")
    full = _full(config, with_optimizer=False)
    for t in range(2):
        torch.save({"module": {}, "iteration": 2, "config": full.config},
                   step / f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt")
    assert convert.main(["--model-type", "GPT", "--loader", "deepspeed", "--load-dir",
                         str(tmp_path / "ds"), "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "ZeRO-3 checkpoint at tensor-parallel size 2" in err and "ZeRO 0-2" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tp,pp,per_chunk,words", [
    (3, 1, None, "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"),
    (1, 4, None, "--num-layers (6) is not divisible by --pipeline-model-parallel-size (4)"),
    (1, 2, 1, "needs --pipeline-model-parallel-size > 2"),
    (1, 3, 2, "is the whole stage"),
])
def test_layouts_that_do_not_fit_are_refused_before_writing(tmp_path, tp, pp, per_chunk, words):
    with pytest.raises(ValueError, match="cannot save at tensor-parallel size") as info:
        save_full_checkpoint(_full(_config(), with_optimizer=False), str(tmp_path / "out"), tp,
                             pp, num_layers_per_virtual_pipeline_stage=per_chunk)
    assert words in str(info.value)
    assert not (tmp_path / "out").exists()


def test_saved_chunks_are_placed_by_their_layer_counts():
    """An uneven split (--decoder-first-pipeline-num-layers) and interleaving, read back from
    how many layers each saved chunk holds, match the layout training builds."""
    uneven = pipeline_chunks(6, 2, first_stage_layers=2)
    assert [[c.first_layer for c in s] for s in uneven] == [[0], [2]]
    assert chunks_from_layer_counts([[2], [4]]) == uneven
    interleaved = pipeline_chunks(6, 3, vp=2)
    assert [[c.first_layer for c in s] for s in interleaved] == [[0, 3], [1, 4], [2, 5]]
    assert chunks_from_layer_counts([[1, 1]] * 3) == interleaved

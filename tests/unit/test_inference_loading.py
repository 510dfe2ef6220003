"""megatron/inference/loading.py's choices without a model: which layout a checkpoint runs at,
what a launch at another layout reads, and where a moved checkpoint's tokenizer is found."""

import os

import pytest
import torch

from megatron.checkpointing.run_config import with_layout
from megatron.config import DataConfig, ModelConfig, to_dict
from megatron.conversion.full import FullCheckpoint, save_full_checkpoint
from megatron.conversion.hf import TOKENIZER_DIR
from megatron.inference.loading import (
    InferenceLoadingError,
    build_inference_model,
    checkpoint_tokenizer_settings,
    config_from_checkpoint,
    launch_layout,
)
from megatron.model.gpt_model import GPTModel


def test_launch_layout():
    assert launch_layout((2, 2), 4) == (2, 2)  # the processes fit the saved layout
    assert launch_layout((2, 2), 1) == (1, 1)
    assert launch_layout((2, 1), 4) == (4, 1)  # else tensor parallel over all of them
    assert launch_layout((2, 2), 4, 4, None) == (4, 1)
    assert launch_layout((2, 2), 4, None, 4) == (1, 4)
    with pytest.raises(InferenceLoadingError, match="--tensor-model-parallel-size 2 x "
                       "--pipeline-model-parallel-size 2 needs 4 processes; 2"):
        launch_layout((1, 1), 2, 2, 2)


def _save(tmp_path, tp: int, pp: int, vp_layers=None) -> tuple[str, dict]:
    model = ModelConfig(num_layers=6, hidden_size=16, num_attention_heads=4, seq_length=16,
                        max_position_embeddings=16, vocab_size=50,
                        make_vocab_size_divisible_by=8)
    torch.manual_seed(0)
    state = GPTModel(model, device=torch.device("cpu")).state_dict()
    config = with_layout({"model": to_dict(model), "data": {"tokenizer_type": "NullTokenizer",
                                                            "vocab_size": 49}}, 1, 1)
    save_full_checkpoint(FullCheckpoint(config=config, model=state, release=True),
                         str(tmp_path), tp, pp, num_layers_per_virtual_pipeline_stage=vp_layers)
    return str(tmp_path), state


@pytest.mark.parametrize("tp, pp, vp_layers", [(2, 2, None), (1, 3, 1)])
def test_checkpoint_at_another_layout_loads_the_same_weights(tmp_path, tp, pp, vp_layers):
    """Saved at tp 2 x pp 2, or pp 3 with two virtual stages each, run in one process."""
    load_dir, state = _save(tmp_path, tp, pp, vp_layers)
    config = config_from_checkpoint(load_dir, 1)
    p = config.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (1, 1)
    model = build_inference_model(config, device=torch.device("cpu"))
    assert not model.training
    got = model.state_dict()
    assert got.keys() == state.keys()
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_moved_checkpoint_finds_its_kept_tokenizer(tmp_path):
    kept = tmp_path / TOKENIZER_DIR
    kept.mkdir()
    (kept / "vocab.json").write_text("{}")
    data = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="/gone/tokenizer/vocab.json",
                      merge_file="/gone/tokenizer/merges.txt")
    settings = checkpoint_tokenizer_settings(data, str(tmp_path))
    assert settings["vocab_file"] == os.path.join(str(tmp_path), TOKENIZER_DIR, "vocab.json")
    assert settings["merge_file"] == "/gone/tokenizer/merges.txt"  # no copy: left as recorded
    assert settings["tokenizer_type"] == "GPT2BPETokenizer"


def test_megatron_deepspeed_checkpoint_runs_at_any_layout(tmp_path):
    """A Megatron-DeepSpeed checkpoint (their ``language_model`` names, their flags as an
    argparse ``args``) saved at tp 2 x pp 2: its configuration is read from the flags and its
    weights by the conversion reader, also at its own layout (the per-rank loader reads
    ours only)."""
    import argparse

    from megatron.inference.loading import _saved_at_this_layout
    from tests.unit.test_conversion import _megatron_deepspeed_model

    ours, state = _save(tmp_path / "ours", 2, 2)
    args = argparse.Namespace(num_layers=6, hidden_size=16, num_attention_heads=4,
                              ffn_hidden_size=64, seq_length=16, max_position_embeddings=16,
                              make_vocab_size_divisible_by=8, padded_vocab_size=64,
                              true_vocab_size=50, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=2, tokenizer_type="NullTokenizer")
    theirs = tmp_path / "theirs"
    for rank_dir in ("mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"):
        saved = torch.load(os.path.join(ours, "release", rank_dir, "model_optim_rng.pt"),
                           weights_only=True)
        os.makedirs(theirs / "release" / rank_dir)
        torch.save({"checkpoint_version": 3.0, "iteration": 0, "args": args,
                    "model": _megatron_deepspeed_model(saved["model"])},
                   theirs / "release" / rank_dir / "model_optim_rng.pt")
    (theirs / "latest_checkpointed_iteration.txt").write_text("release")
    config = config_from_checkpoint(str(theirs), 1)
    assert (config.model.vocab_size, config.model.num_layers) == (50, 6)
    assert config.data.tokenizer_type == "NullTokenizer"
    got = build_inference_model(config, device=torch.device("cpu")).state_dict()
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    assert _saved_at_this_layout(config_from_checkpoint(ours, 4))
    assert not _saved_at_this_layout(config_from_checkpoint(str(theirs), 4))

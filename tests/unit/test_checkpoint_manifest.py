"""Verified checkpoints in one process: the manifest a save writes, what loading checks
against it (damaged, truncated and missing files named; --no-verify-checkpoint; folders
without one), model flags compared with the saved config, and the --load/--save checks."""

from __future__ import annotations

import argparse
import json
import logging
import os
import zlib

import pytest
import torch

from megatron import checkpointing as ckpt
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.model.gpt_model import GPTModel
from tests.checkpoint_utils import flip_bytes, folder_state
from tests.unit.test_checkpointing import (
    assert_params_equal,
    batch,
    build,
    params,
    resumed_run,
    run_config,
    train_step,
    trained_run,
)


def saved_checkpoint(tmp_path, iteration: int = 2, **checkpoint):
    """A config, a model trained ``iteration`` steps and saved, and its weights."""
    config = run_config(tmp_path, **checkpoint)
    model, optimizer, scheduler = build(config)
    for step in range(iteration):
        train_step(model, optimizer, scheduler, batch(step))
    ckpt.save_checkpoint(iteration, model, optimizer, scheduler, config,
                         consumed_train_samples=2 * iteration)
    return config, params(model)


def fresh(config, seed: int = 31):
    return build(config, seed=seed)


@pytest.fixture
def digests(monkeypatch):
    """The files whose checksum loading computes, in order."""
    from megatron.checkpointing import manifest as manifest_module

    seen = []
    real = manifest_module.file_digest

    def spy(path):
        seen.append(path)
        return real(path)

    monkeypatch.setattr(manifest_module, "file_digest", spy)
    return seen


# The manifest a save writes ----------------------------------------------------------------


def test_manifest_records_every_file_the_layout_and_the_config(tmp_path):
    config, _ = saved_checkpoint(tmp_path, iteration=3)
    iter_dir = tmp_path / "iter_0000003"
    manifest = json.loads((iter_dir / "manifest.json").read_text())
    assert manifest["manifest_version"] == 1 and manifest["iteration"] == 3
    assert manifest["checkpoint_version"] == 3.0 and manifest["checksum"] == "crc32"
    assert manifest["parallel_layout"] == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "data_parallel_size": 1, "num_model_chunks": 1}
    data = (iter_dir / "mp_rank_00" / "model_optim_rng.pt").read_bytes()
    assert manifest["files"] == {"mp_rank_00/model_optim_rng.pt": {
        "size": len(data), "crc32": f"{zlib.crc32(data):08x}"}}
    assert manifest["config"] == json.loads(json.dumps(config.to_dict()))
    assert manifest["config"]["model"]["hidden_size"] == 32
    assert ckpt.load_checkpoint_config(str(tmp_path)) == manifest["config"]
    assert ckpt.read_manifest(str(iter_dir)) == manifest


def test_normal_resume_is_verified_and_bit_identical(tmp_path, digests, caplog):
    config = run_config(tmp_path)
    _, ref_losses, ref_params, ref_draws = trained_run(config)
    with caplog.at_level(logging.WARNING, logger="megatron.checkpointing"):
        loaded, losses, final, draws, _ = resumed_run(config)
    assert tuple(loaded) == (2, 4, 0)
    assert digests == [ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)]  # checksummed once
    assert "not verified" not in caplog.text
    assert losses == ref_losses
    assert_params_equal(final, ref_params)
    assert draws == ref_draws


# Damaged files are named, and nothing is loaded --------------------------------------------


def _load_fails(config, match: str):
    """Load into a fresh model; assert it raises ``match`` and the model kept its weights."""
    model, optimizer, scheduler = fresh(config)
    before = params(model)
    with pytest.raises(ckpt.CheckpointError, match=match) as info:
        ckpt.load_checkpoint(model, optimizer, scheduler, config)
    assert type(info.value).__name__ == "CheckpointCorruptError"
    assert_params_equal(params(model), before)
    assert not optimizer.state
    return str(info.value)


def test_flipped_bytes_fail_the_load_naming_the_file(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    path = ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    recorded = json.loads((tmp_path / "iter_0000002" / "manifest.json").read_text())
    size = os.path.getsize(path)
    flip_bytes(path)
    assert os.path.getsize(path) == size
    before = folder_state(tmp_path)
    message = _load_fails(config, "is damaged: its CRC-32 is")
    assert path in message
    assert recorded["files"]["mp_rank_00/model_optim_rng.pt"]["crc32"] in message
    assert f"same size, {size} bytes" in message
    assert "Restore the file from a copy" in message
    assert folder_state(tmp_path) == before  # the load left everything as it was


def test_damage_names_other_checkpoints_to_resume_from(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    model, optimizer, scheduler = fresh(config)
    ckpt.save_checkpoint(4, model, optimizer, scheduler, config, consumed_train_samples=8)
    flip_bytes(ckpt.checkpoint_path(str(tmp_path), 4, 0, 0, 1))
    message = _load_fails(config, "is damaged")
    assert "another checkpoint of --load" in message and "(2)" in message
    assert os.path.join(str(tmp_path), "latest_checkpointed_iteration.txt") in message


def test_truncated_file_is_named_with_both_sizes(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    path = ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    message = _load_fails(config, "is damaged: it has")
    assert path in message and f"{size - 100} bytes" in message and f"recorded {size}" in message
    assert "(truncated)" in message


def test_missing_file_is_named(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    path = ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    size = os.path.getsize(path)
    os.remove(path)
    message = _load_fails(config, "does not exist")
    assert path in message and f"with {size} bytes" in message


def test_file_of_another_save_is_named(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    manifest_path = tmp_path / "iter_0000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {"mp_rank_01/model_optim_rng.pt": {"size": 1, "crc32": "00000000"}}
    manifest_path.write_text(json.dumps(manifest))
    _load_fails(config, "model_optim_rng.pt is not listed in .*manifest.json")


def test_unreadable_manifest_is_named(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    manifest_path = tmp_path / "iter_0000002" / "manifest.json"
    manifest_path.write_text('{"files": {"mp_rank_00/model_optim_rng.pt": ')
    message = _load_fails(config, "cannot read the checkpoint manifest")
    assert str(manifest_path) in message


# --no-verify-checkpoint, and folders without a manifest -------------------------------------


def test_no_verify_checkpoint_skips_the_checksums_not_the_sizes(tmp_path, digests):
    config, saved = saved_checkpoint(tmp_path, no_verify_checkpoint=True)
    path = ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    flip_bytes(path)
    model, optimizer, scheduler = fresh(config)
    assert ckpt.load_checkpoint(model, optimizer, scheduler, config).iteration == 2
    assert digests == []
    changed = [k for k, v in params(model).items() if not torch.equal(v, saved[k])]
    assert changed  # what the flag risks: the flipped numbers were loaded
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    _load_fails(config, "is damaged: it has")


def test_checkpoint_without_manifest_loads_with_one_notice(tmp_path, caplog, digests):
    config, saved = saved_checkpoint(tmp_path)
    os.remove(tmp_path / "iter_0000002" / "manifest.json")
    model, optimizer, scheduler = fresh(config)
    with caplog.at_level(logging.WARNING, logger="megatron.checkpointing"):
        assert ckpt.load_checkpoint(model, optimizer, scheduler, config).iteration == 2
    notices = [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
    assert len(notices) == 1
    assert str(tmp_path / "iter_0000002") in notices[0] and "no manifest.json" in notices[0]
    assert digests == []
    assert_params_equal(params(model), saved)


# Model flags against the saved config ------------------------------------------------------


def _model_with(config, **model_changes):
    """A run config whose model differs by ``model_changes``, and its model."""
    changed = config.replace(model=config.model.replace(**model_changes))
    model_parallel_seed(1)
    return changed, GPTModel(changed.model)


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "file-config"])
def test_hidden_size_mismatch_names_the_flag(tmp_path, with_manifest):
    config, _ = saved_checkpoint(tmp_path)
    if not with_manifest:  # the same check from the config inside model_optim_rng.pt
        os.remove(tmp_path / "iter_0000002" / "manifest.json")
    bigger, model = _model_with(config, hidden_size=64, ffn_hidden_size=128, kv_channels=8)
    before = params(model)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(model, None, None, bigger)
    message = str(info.value)
    assert f"checkpoint {tmp_path / 'iter_0000002'} (--load {tmp_path}) has " in message
    assert "--hidden-size 32, you asked for 64" in message
    assert "--ffn-hidden-size" not in message and "--kv-channels" not in message
    assert "size mismatch" not in message
    assert_params_equal(params(model), before)


def test_every_shape_flag_is_compared(tmp_path):
    config, _ = saved_checkpoint(tmp_path)
    changed, model = _model_with(
        config, num_layers=3, num_attention_heads=2, kv_channels=16, ffn_hidden_size=64,
        max_position_embeddings=32, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, vocab_size=700)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(model, None, None, changed)
    message = str(info.value)
    for part in ("--num-layers 2, you asked for 3", "--num-attention-heads 4, you asked for 2",
                 "--ffn-hidden-size 128, you asked for 64", "--kv-channels 8, you asked for 16",
                 "--max-position-embeddings 16, you asked for 32",
                 "--untie-embeddings-and-output-weights off, you asked for on",
                 "--disable-bias-linear off, you asked for on",
                 "a padded vocabulary of 512 (vocabulary 500), you asked for 768"):
        assert part in message, (part, message)
    rope, model = _model_with(config, position_embedding_type="rope")
    with pytest.raises(ckpt.CheckpointError, match="--position-embedding-type learned_absolute, "
                                                   "you asked for rope"):
        ckpt.load_checkpoint(model, None, None, rope)


def test_megatron_args_are_compared_too(tmp_path):
    """A Megatron(-DeepSpeed) checkpoint stores its flags as an argparse Namespace."""
    config = run_config(tmp_path)
    model, _, _ = build(config)
    state = {"args": argparse.Namespace(hidden_size=48, num_layers=2, padded_vocab_size=512),
             "checkpoint_version": 3.0, "iteration": 7, "model": model.state_dict()}
    os.makedirs(tmp_path / "iter_0000007" / "mp_rank_00")
    torch.save(state, ckpt.checkpoint_path(str(tmp_path), 7, 0, 0, 1))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(ckpt.CheckpointError, match="has --hidden-size 48, you asked for 32"):
        ckpt.load_checkpoint(model, None, None, run_config(tmp_path, no_load_optim=True))


# --load and --save ------------------------------------------------------------------------


def test_load_of_a_regular_file_names_the_flag(tmp_path):
    config, saved = saved_checkpoint(tmp_path / "ckpt")
    path = ckpt.checkpoint_path(str(tmp_path / "ckpt"), 2, 0, 0, 1)
    model, optimizer, scheduler = fresh(config)
    with pytest.raises(ckpt.CheckpointError, match=f"--load {path} is a file, not a "
                                                   "checkpoint folder"):
        ckpt.load_checkpoint(model, optimizer, scheduler, run_config(path))
    iter_dir = str(tmp_path / "ckpt" / "iter_0000002")
    with pytest.raises(ckpt.CheckpointError, match="is one iteration's folder.*pass its parent"):
        ckpt.load_checkpoint(model, optimizer, scheduler, run_config(iter_dir))
    assert ckpt.load_checkpoint(model, optimizer, scheduler, config).iteration == 2


def test_save_folder_checks(tmp_path, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    with pytest.raises(ckpt.CheckpointError, match=f"--save {a_file} is a file, not a folder"):
        ckpt.check_save_dir(str(a_file))
    under = a_file / "ckpt"
    with pytest.raises(ckpt.CheckpointError, match=f"--save {under} cannot be created: "
                                                   f"{a_file} is a file"):
        ckpt.check_save_dir(str(under))
    assert a_file.read_text() == "keep me"
    ckpt.check_save_dir(str(tmp_path / "new" / "deeper"))  # creatable: fine, and not created
    ckpt.check_save_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # the write probe was removed

    # Permission bits do not stop root, which runs these tests: refuse the probe instead.
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    from megatron.checkpointing import paths as paths_module

    monkeypatch.setattr(paths_module.tempfile, "mkstemp", refuse)
    with pytest.raises(ckpt.CheckpointError, match=f"--save {tmp_path / 'new'} is not writable "
                                                   f"\\(in {tmp_path}\\): Permission denied"):
        ckpt.check_save_dir(str(tmp_path / "new"))


def test_unwritable_save_folder_when_not_root(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(ckpt.CheckpointError, match="is not writable"):
            ckpt.check_save_dir(str(folder))
    finally:
        folder.chmod(0o755)

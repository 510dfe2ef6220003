"""megatron/checkpointing/folder.py in one process: checkpoints are found by their
completeness, not by the tracker alone (issue 24), and each format's folder is described by
one module (issue 23)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil

import pytest
import torch

from megatron import checkpointing as ckpt
from megatron.checkpointing import folder as folders
from megatron.checkpointing import format as formats
from tests.unit.test_checkpoint_manifest import fresh, saved_checkpoint
from tests.unit.test_checkpointing import (
    assert_params_equal,
    batch,
    params,
    run_config,
    train_step,
)

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """Iterations 2 and 4 saved once for the module; the weights of each."""
    root = tmp_path_factory.mktemp("saved")
    config, at2 = saved_checkpoint(root, iteration=2)
    model, optimizer, scheduler = fresh(config)
    ckpt.load_checkpoint(model, optimizer, scheduler, config)
    for step in (2, 3):
        train_step(model, optimizer, scheduler, batch(step))
    ckpt.save_checkpoint(4, model, optimizer, scheduler, config, consumed_train_samples=8)
    return root, {2: at2, 4: params(model)}


@pytest.fixture
def two_saves(saved_once, tmp_path):
    """A copy of the two saves in tmp_path (the checkpoint folder), its config and weights."""
    root, weights = saved_once
    shutil.rmtree(tmp_path)
    shutil.copytree(root, tmp_path)
    return run_config(tmp_path), weights


def _load(config, caplog):
    model, optimizer, scheduler = fresh(config)
    with caplog.at_level(logging.WARNING, logger="megatron.checkpointing"):
        loaded = ckpt.load_checkpoint(model, optimizer, scheduler, config)
    return loaded, params(model)


@pytest.mark.parametrize("tracker", ["missing", "empty", "names-a-gone-folder",
                                     "names-a-truncated-folder"])
def test_newest_complete_folder_is_loaded_when_the_tracker_fails(two_saves, tmp_path, caplog,
                                                                 tracker):
    config, weights = two_saves
    path = tmp_path / TRACKER
    expected = 4
    if tracker == "missing":
        path.unlink()
        why = f"{path} is missing"
    elif tracker == "empty":
        path.write_text("")  # what a full disk left when writing it
        why = f"{path} is empty"
    elif tracker == "names-a-gone-folder":
        path.write_text("6")
        why = f"{path} names iter_0000006, which does not exist"
    else:
        model_file = ckpt.checkpoint_path(str(tmp_path), 4, 0, 0, 1)
        with open(model_file, "r+b") as f:
            f.truncate(1000)
        expected = 2
        why = f"{path} names {tmp_path / 'iter_0000004'}, which is incomplete"
    loaded, got = _load(config, caplog)
    assert loaded.iteration == expected
    assert_params_equal(got, weights[expected])
    assert why in caplog.text
    assert f"loading {tmp_path / f'iter_{expected:07d}'} instead" in caplog.text


def test_folders_without_a_manifest_or_with_a_missing_file_are_passed_over(two_saves,
                                                                           tmp_path, caplog):
    config, weights = two_saves
    (tmp_path / TRACKER).unlink()
    os.remove(tmp_path / "iter_0000004" / "manifest.json")  # e.g. a save of an older version
    assert ckpt.latest_checkpoint(str(tmp_path)).iteration == 2
    os.remove(ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1))
    caplog.clear()
    loaded, _ = _load(config, caplog)
    assert loaded.iteration == 0 and loaded.report is None  # nothing complete: from scratch
    assert "no other folder of" in caplog.text and "iter_0000002, iter_0000004" in caplog.text


def test_a_damaged_tracker_folder_without_an_alternative_is_still_named(tmp_path, caplog):
    """With nothing to fall back on, the load reports the damage as before (the file, the
    sizes, and what to do), instead of starting from scratch."""
    config, _ = saved_checkpoint(tmp_path)
    model_file = ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    with open(model_file, "r+b") as f:
        f.truncate(1000)
    model, optimizer, scheduler = fresh(config)
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint file {model_file} is damaged"):
        ckpt.load_checkpoint(model, optimizer, scheduler, config)


def test_the_tracker_wins_over_a_newer_complete_folder(two_saves, tmp_path):
    """A tracker set back by hand (or a crash between publishing and the tracker) is obeyed."""
    config, weights = two_saves
    (tmp_path / TRACKER).write_text("2")
    model, optimizer, scheduler = fresh(config)
    assert ckpt.load_checkpoint(model, optimizer, scheduler, config).iteration == 2


def test_conversion_and_the_stored_config_use_the_same_fallback(two_saves, tmp_path):
    from megatron.conversion import load_full_checkpoint

    config, weights = two_saves
    (tmp_path / TRACKER).unlink()
    full = load_full_checkpoint(str(tmp_path))
    assert full.iteration == 4
    assert ckpt.load_checkpoint_config(str(tmp_path))["model"]["hidden_size"] == 32


def test_formats_are_told_by_their_files(tmp_path):
    torch_dir = tmp_path / "iter_0000003"
    (torch_dir / "mp_rank_00_000").mkdir(parents=True)
    (torch_dir / "mp_rank_01_001").mkdir()
    ds_dir = tmp_path / "global_step3"
    ds_dir.mkdir()
    (ds_dir / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ds_dir / "mp_rank_01_model_states.pt").write_bytes(b"x")
    torch_folder = folders.CheckpointFolder(str(tmp_path), str(torch_dir), 3)
    assert torch_folder.format.name == "torch" and torch_folder.layout() == (2, 2)
    ds_folder = folders.CheckpointFolder(str(tmp_path), str(ds_dir), 3, naming=folders.DEEPSPEED)
    assert ds_folder.format.name == "deepspeed" and ds_folder.layout() == (2, 1)
    # A format registered by its own module (torch_dist) is recognised the same way.
    dist_dir = tmp_path / "iter_0000005"
    dist_dir.mkdir()
    (dist_dir / ".metadata").write_bytes(b"x")
    class FakeDist:  # only what telling a folder's format and layout asks of a Format
        name, naming, fallback = "fake_dist", folders.MEGATRON, False

        def recognise(self, d):
            return os.path.isfile(os.path.join(d, ".metadata"))

        def layout(self, d):
            return (4, 1)

    fake = FakeDist()
    formats.register_format(fake)
    try:
        folder = folders.checkpoint_at(str(tmp_path), 5)
        assert folder.format is fake and folder.layout() == (4, 1)
        assert folders.checkpoint_at(str(tmp_path), 3).format.name == "torch"
    finally:
        formats._FORMATS.pop("fake_dist")
    assert folders.DEEPSPEED.tracker_text(7) == "global_step7"
    assert folders.DEEPSPEED.parse_tracker("global_step7", "latest") == (7, False)
    assert folders.MEGATRON.parse_tracker("release", TRACKER) == (0, True)
    with pytest.raises(ckpt.CheckpointError, match="expected a folder name global_stepN"):
        folders.DEEPSPEED.parse_tracker("iter_7", "latest")
    shutil.rmtree(torch_dir)


def test_a_roots_kind_is_told_by_its_tracker_else_by_its_folders(two_saves, tmp_path):
    import torch

    assert folders.namings_in(str(tmp_path)) == [folders.MEGATRON]
    assert folders.find_checkpoint(str(tmp_path)).iteration == 4
    (tmp_path / TRACKER).unlink()  # iteration folders alone: ours, the newest complete one
    assert folders.namings_in(str(tmp_path)) == [folders.MEGATRON]
    assert folders.find_checkpoint(str(tmp_path)).iteration == 4
    ds = tmp_path / "ds"
    (ds / "global_step3").mkdir(parents=True)
    client = {"config": {"model": {"hidden_size": 8},
                         "parallel": {"tensor_model_parallel_size": 2,
                                      "pipeline_model_parallel_size": 2}}}
    torch.save(client, ds / "global_step3" / "mp_rank_00_model_states.pt")
    assert folders.namings_in(str(ds)) == [folders.DEEPSPEED]
    found = folders.find_checkpoint(str(ds))  # no 'latest': the newest folder, if complete
    assert found is None  # no manifest: not known to be complete
    (ds / "latest").write_text("global_step3")
    found = folders.find_checkpoint(str(ds))
    assert found.naming is folders.DEEPSPEED and found.format.name == "deepspeed"
    # Without a manifest the layout is the stored configuration's (a pipeline's stages are
    # not told apart by DeepSpeed's file names).
    assert found.layout() == (2, 2) and found.config()["model"] == {"hidden_size": 8}
    assert found.format.common(found.path)["config"] == client["config"]
    # Both trackers: ours, as --load without --deepspeed reads it.
    (ds / TRACKER).write_text("4")
    assert folders.namings_in(str(ds)) == [folders.MEGATRON, folders.DEEPSPEED]
    assert folders.find_checkpoint(str(tmp_path / "none")) is None
    assert str(folders.no_checkpoint_error(str(ds), "--load")) == (
        f"--load {ds} holds no checkpoint (no {TRACKER}, nor DeepSpeed's 'latest' file)")
    assert str(folders.no_checkpoint_error("x", "--a", namings=(folders.MEGATRON,))) == (
        f"--a x holds no checkpoint (no {TRACKER})")


def test_the_layout_is_the_manifests_when_a_ranks_files_are_gone(tmp_path):
    from megatron.checkpointing.manifest import read_manifest, write_manifest

    iter_dir = tmp_path / "iter_0000002"
    (iter_dir / "mp_rank_00").mkdir(parents=True)
    manifest = {"format": "megatron-gpt-checkpoint", "version": 1, "iteration": 2, "files": {},
                "parallel_layout": {"tensor_model_parallel_size": 2,
                                    "pipeline_model_parallel_size": 1}}
    write_manifest(str(iter_dir), manifest)
    assert read_manifest(str(iter_dir)) is not None
    folder = folders.checkpoint_at(str(tmp_path), 2)
    assert folder.layout() == (2, 1)  # mp_rank_01 is gone; its files tell (1, 1)
    assert folder.format.layout(folder.path) == (1, 1)


def test_the_start_up_schedule_look_ahead_finds_the_loads_folder_quietly(two_saves, tmp_path,
                                                                        caplog):
    """The start-up schedule check reads the folder the load will take (the newest complete
    one here); the fallback's warning is the load's, said once."""
    config, _ = two_saves
    (tmp_path / TRACKER).unlink()
    with caplog.at_level(logging.WARNING, logger="megatron.checkpointing"):
        folder, schedule = ckpt.load_scheduler_state(str(tmp_path))
    assert folder == str(tmp_path / "iter_0000004") and "num_steps" in schedule
    assert caplog.text == ""
    loaded, _ = _load(config, caplog)
    assert loaded.iteration == 4 and caplog.text.count("is missing; loading") == 1


@pytest.mark.parametrize("gqa, groups, expected", [(False, 1, None), (True, 2, 2)])
def test_checkpoint_args_of_megatron_lm_keep_num_query_groups_only_with_gqa(
        tmp_path, gqa, groups, expected):
    """Megatron-LM stores --num-query-groups 1 even without --group-query-attention; with
    --use-checkpoint-args that must not turn every head into one group (multi-query)."""
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                              group_query_attention=gqa, num_query_groups=groups)
    rank_dir = tmp_path / "iter_0000001" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({"args": args, "iteration": 1, "checkpoint_version": 3.0},
               rank_dir / "model_optim_rng.pt")
    (tmp_path / TRACKER).write_text("1")
    settings = ckpt.checkpoint_model_settings(str(tmp_path))
    assert settings.get("num_query_groups") == expected
    assert settings["num_attention_heads"] == 4 and settings["group_query_attention"] is gqa


@pytest.mark.parametrize("experts, freq, expected", [(None, 1, None), (4, [1, 0], "[1, 0]")])
def test_checkpoint_args_take_the_experts_only_of_a_model_with_experts(
        tmp_path, experts, freq, expected):
    """Megatron-LM stores its MoE arguments (--moe-layer-freq as an int or a list) in dense
    checkpoints too: --use-checkpoint-args takes them only with --num-experts above 1, the
    layer list as the flag's string."""
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                              num_experts=experts, moe_layer_freq=freq, moe_router_topk=2,
                              moe_shared_expert_gate=False)
    rank_dir = tmp_path / "iter_0000001" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({"args": args, "iteration": 1, "checkpoint_version": 3.0},
               rank_dir / "model_optim_rng.pt")
    (tmp_path / TRACKER).write_text("1")
    settings = ckpt.checkpoint_model_settings(str(tmp_path))
    assert settings.get("moe_layer_freq") == expected
    assert ("moe_router_topk" in settings) is (experts is not None)

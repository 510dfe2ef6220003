"""--load says on one line what it read and what starts anew (optimizer, LR schedule, RNG,
iteration), from what load_checkpoint reports it restored."""

from __future__ import annotations

import os

import pytest
import torch

from megatron import checkpointing as ckpt
from megatron.checkpointing.contents import CONVERTED_KEY
from megatron.training.log import format_load_report
from tests.unit.test_checkpointing import MICRO_BATCH, build, run_config, trained_run

ALL = "restored: model, optimizer state, LR schedule, RNG state"


@pytest.mark.parametrize("options, release, tail", [
    ({}, False, f"(ITER, 4 samples consumed); {ALL}"),
    ({"finetune": True}, False, "(ITER); restored: model; reset (--finetune): optimizer state, "
                               "LR schedule, RNG state, iteration to 0"),
    ({}, True, "(ITER); restored: model; reset (release checkpoint): optimizer state, "
               "LR schedule, RNG state, iteration to 0"),
    ({"no_load_optim": True, "no_load_rng": True}, False,
     "(ITER, 4 samples consumed); restored: model; reset (--no-load-optim): optimizer state, "
     "LR schedule; reset (--no-load-rng): RNG state"),
    ({"no_load_lr_state": True}, False, "(ITER, 4 samples consumed); restored: model, "
                                        "optimizer state, RNG state; reset "
                                        "(--no-load-lr-state): LR schedule"),
], ids=["resume", "finetune", "release", "no-load-optim-rng", "no-load-lr-state"])
def test_load_line_says_what_was_restored_and_reset(tmp_path, options, release, tail):
    config = run_config(tmp_path)
    trained_run(config, steps_after=0)  # a checkpoint of iteration 2
    folder = tmp_path / "iter_0000002"
    if release:
        folder = folder.rename(tmp_path / "release")
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    load_config = run_config(tmp_path, **options)
    model, optimizer, scheduler = build(config, seed=31)
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler, load_config)
    line = format_load_report(loaded.report, load_config.checkpoint,
                              loaded.consumed_train_samples)
    iteration = 0 if release else 2
    assert line == (f"successfully loaded checkpoint from {tmp_path} at iteration {iteration} "
                    + tail.replace("ITER", os.fspath(folder)))
    assert loaded.consumed_train_samples in (0, 2 * MICRO_BATCH)


def test_nothing_to_load_reports_nothing(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    assert ckpt.load_checkpoint(model, optimizer, scheduler, config).report is None


def test_converted_checkpoint_says_generators_start_from_seed(tmp_path):
    """A converted checkpoint holds no RNG state: the line must not claim it was restored."""
    config = run_config(tmp_path)
    trained_run(config, steps_after=0)
    folder = tmp_path / "iter_0000002"
    path = ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    state = torch.load(path, weights_only=False)
    del state["rng_state"]
    state[CONVERTED_KEY] = "a full checkpoint"
    torch.save(state, path)
    os.remove(folder / "manifest.json")  # the rewritten file no longer matches it
    model, optimizer, scheduler = build(config, seed=31)
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler, config)
    line = format_load_report(loaded.report, config.checkpoint, loaded.consumed_train_samples)
    assert line == (f"successfully loaded checkpoint from {tmp_path} at iteration 2 ({folder}, "
                    "4 samples consumed); restored: model, optimizer state, LR schedule; reset "
                    "(none stored for this layout, generators start from --seed): RNG state")
    assert not loaded.report.rng and loaded.report.rng_from_seed

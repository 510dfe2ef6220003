"""Checkpoint save/load in one process: layout, bit-exact resumption, atomicity, errors."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron import checkpointing as ckpt
from megatron.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.model.gpt_model import GPTModel

MICRO_BATCH = 2


# Helpers shared with tests/distributed/test_checkpointing_dist.py ------------------------------


def run_config(save_dir=None, *, tp: int = 1, pp: int = 1, world_size: int = 1,
               dropout: float = 0.1, precision: str = "fp32", distributed_optimizer: bool = False,
               **checkpoint) -> RunConfig:
    """A tiny GPT run whose checkpoints go to (and come from) ``save_dir``."""
    fp16, bf16 = precision == "fp16", precision == "bf16"
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=500, hidden_dropout=dropout, attention_dropout=dropout,
                        tensor_model_parallel_size=tp, fp16=fp16, bf16=bf16)
    checkpoint.setdefault("save", None if save_dir is None else str(save_dir))
    checkpoint.setdefault("load", checkpoint["save"])
    checkpoint.setdefault("save_interval", 1)
    return RunConfig(
        model=model,
        parallel=ParallelConfig(world_size=world_size, tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=pp),
        optimizer=OptimizerConfig(lr=1e-3, fp16=fp16, bf16=bf16, initial_loss_scale=2.0**20,
                                  use_distributed_optimizer=distributed_optimizer),
        data=DataConfig(tokenizer_type="NullTokenizer", vocab_size=500),
        checkpoint=CheckpointConfig(**checkpoint),
    )


def build_scheduler(optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                   lr_warmup_steps=2, lr_decay_steps=20, lr_decay_style="cosine",
                                   start_wd=0.01, end_wd=0.1, wd_incr_steps=20,
                                   wd_incr_style="linear")


def batch(step: int, micro_batch: int = MICRO_BATCH, vocab: int = 500) -> torch.Tensor:
    """The tokens of training step ``step``: fixed data, independent of the global RNG."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (micro_batch, 17), generator=g)


def train_step(model, optimizer, scheduler, tokens: torch.Tensor) -> float:
    """Forward/backward/step on a model not wrapped for data parallel."""
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
    if hasattr(optimizer, "scale_loss"):  # a Megatron optimizer (loss scaling under fp16)
        optimizer.scale_loss(loss).backward()
    else:
        loss.backward()
    optimizer.step()
    scheduler.step(1)
    return loss.item()


def scramble_rngs(seed: int = 99) -> None:
    """Put every generator somewhere a resumed run must not continue from."""
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed)


def side_draws() -> tuple:
    """One draw from each generator the checkpoint restores (python, numpy, torch, tracker)."""
    with get_rng_tracker().fork():
        tracked = torch.rand(2)
    return random.random(), float(np.random.rand()), torch.rand(2).tolist(), tracked.tolist()


# -----------------------------------------------------------------------------------------------


def build(config: RunConfig, kind: str = "fp32", seed: int = 5):
    model_parallel_seed(seed)
    model = GPTModel(config.model)
    if kind == "torch_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        optimizer = get_megatron_optimizer(config.optimizer, [model])
    return model, optimizer, build_scheduler(optimizer)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def trained_run(config, kind="fp32", steps_before=2, steps_after=3, **save_kwargs):
    """Train, save at ``steps_before``, keep training: the uninterrupted reference."""
    model, optimizer, scheduler = build(config, kind)
    for step in range(steps_before):
        train_step(model, optimizer, scheduler, batch(step))
    saved = params(model)
    ckpt.save_checkpoint(steps_before, [model], optimizer, scheduler, config,
                         consumed_train_samples=steps_before * MICRO_BATCH, **save_kwargs)
    losses = [train_step(model, optimizer, scheduler, batch(steps_before + i))
              for i in range(steps_after)]
    return saved, losses, params(model), side_draws()


def resumed_run(config, kind="fp32", steps_before=2, steps_after=3):
    model, optimizer, scheduler = build(config, kind, seed=77)
    scramble_rngs()
    loaded = ckpt.load_checkpoint([model], optimizer, scheduler, config)
    losses = [train_step(model, optimizer, scheduler, batch(steps_before + i))
              for i in range(steps_after)]
    return loaded, losses, params(model), side_draws(), scheduler


@pytest.mark.parametrize("kind, precision", [("fp32", "fp32"), ("torch_adamw", "fp32"),
                                             ("fp16", "fp16")])
def test_resume_is_bit_identical(tmp_path, kind, precision):
    config = run_config(tmp_path, precision=precision)
    _, ref_losses, ref_params, ref_draws = trained_run(config, kind)
    loaded, losses, final, draws, scheduler = resumed_run(config, kind)
    assert tuple(loaded) == (2, 2 * MICRO_BATCH, 0)
    assert losses == ref_losses
    assert_params_equal(final, ref_params)
    assert draws == ref_draws
    assert scheduler.num_steps == 5


def test_fp16_loss_scaler_state_is_restored(tmp_path):
    config = run_config(tmp_path, precision="fp16")
    model, optimizer, scheduler = build(config)
    optimizer.grad_scaler.update(True)  # an overflow: hysteresis and growth counters move
    optimizer.grad_scaler.update(True)
    scale = float(optimizer.grad_scaler.scale)
    assert scale == 2.0**19
    ckpt.save_checkpoint(1, [model], optimizer, scheduler, config, consumed_train_samples=2)
    model2, optimizer2, scheduler2 = build(config)
    ckpt.load_checkpoint([model2], optimizer2, scheduler2, config)
    assert float(optimizer2.grad_scaler.scale) == scale
    assert optimizer2.grad_scaler.state_dict()["hysteresis_tracker"] == 0


def test_without_rng_restore_the_run_differs(tmp_path):
    """The bit-identical test above relies on the RNG restore (dropout draws differ here)."""
    config = run_config(tmp_path)
    _, ref_losses, _, _ = trained_run(config)
    _, losses, _, _, _ = resumed_run(run_config(tmp_path, no_load_rng=True))
    assert losses != ref_losses


def test_folder_and_tracker_names(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    folder = ckpt.save_checkpoint(100, model, optimizer, scheduler, config,
                                  consumed_train_samples=200)
    assert folder == str(tmp_path / "iter_0000100")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(tmp_path / "iter_0000100")) == ["manifest.json", "mp_rank_00"]
    assert os.listdir(tmp_path / "iter_0000100" / "mp_rank_00") == ["model_optim_rng.pt"]
    assert ckpt.read_tracker(str(tmp_path)) == (100, False)
    assert ckpt.checkpoint_path("S", 100, 1, 0, 1) == "S/iter_0000100/mp_rank_01/model_optim_rng.pt"
    assert ckpt.checkpoint_path("S", 7, 3, 2, 4) == "S/iter_0000007/mp_rank_03_002/model_optim_rng.pt"
    assert ckpt.checkpoint_path("S", 0, 0, 0, 1, release=True) == "S/release/mp_rank_00/model_optim_rng.pt"


def test_file_contents_load_weights_only(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    ckpt.save_checkpoint(3, model, optimizer, scheduler, config, consumed_train_samples=6,
                         consumed_valid_samples=4,
                         extra={"num_floating_point_operations_so_far": 1.5e12})
    state = torch.load(ckpt.checkpoint_path(str(tmp_path), 3, 0, 0, 1), weights_only=True)
    assert state["checkpoint_version"] == 3.0
    assert state["iteration"] == 3
    assert state["config"] == config.to_dict()
    assert state["parallel_layout"]["tensor_model_parallel_size"] == 1
    assert (state["consumed_train_samples"], state["consumed_valid_samples"]) == (6, 4)
    assert state["model"].keys() == model.state_dict().keys()
    assert {"optimizer", "opt_param_scheduler", "rng_state"} <= state.keys()
    assert len(state["rng_state"]) == 1
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler, config)
    assert tuple(loaded) == (3, 6, 4)
    assert loaded.extra == {"num_floating_point_operations_so_far": 1.5e12}
    with pytest.raises(ValueError, match="'iteration'"):
        ckpt.save_checkpoint(4, model, optimizer, scheduler, config, consumed_train_samples=8,
                             extra={"iteration": 1})


def test_no_checkpoint_starts_from_scratch(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    before = params(model)
    assert tuple(ckpt.load_checkpoint(model, optimizer, scheduler, config)) == (0, 0, 0)
    assert tuple(ckpt.load_checkpoint(model, optimizer, scheduler, run_config(None))) == (0, 0, 0)
    assert_params_equal(params(model), before)


def test_finetune_and_release_load_weights_only(tmp_path):
    config = run_config(tmp_path)
    saved, _, _, _ = trained_run(config, steps_after=0)
    for load_config in (run_config(tmp_path, finetune=True), None):
        if load_config is None:  # a release checkpoint: the tracker says "release"
            os.rename(tmp_path / "iter_0000002", tmp_path / "release")
            (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
            load_config = config
        model, optimizer, scheduler = build(config, seed=31)
        loaded = ckpt.load_checkpoint(model, optimizer, scheduler, load_config)
        assert tuple(loaded) == (0, 0, 0)
        assert_params_equal(params(model), saved)
        assert not optimizer.state  # optimizer state left as built
        assert scheduler.num_steps == 0


def test_no_save_optim_and_no_load_optim(tmp_path):
    config = run_config(tmp_path, no_save_optim=True, no_save_rng=True)
    saved, _, _, _ = trained_run(config, steps_after=0)
    state = torch.load(ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1), weights_only=True)
    assert not {"optimizer", "opt_param_scheduler", "rng_state"} & state.keys()
    model, optimizer, scheduler = build(config, seed=31)
    with pytest.raises(ckpt.CheckpointError, match="--no-load-optim"):
        ckpt.load_checkpoint(model, optimizer, scheduler, run_config(tmp_path))
    with pytest.raises(ckpt.CheckpointError, match="--no-load-rng"):
        ckpt.load_checkpoint(model, optimizer, scheduler,
                             run_config(tmp_path, no_load_optim=True))
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler,
                                  run_config(tmp_path, no_load_optim=True, no_load_rng=True))
    assert tuple(loaded) == (2, 2 * MICRO_BATCH, 0)
    assert_params_equal(params(model), saved)


def test_no_load_lr_state_restarts_the_schedule(tmp_path):
    config = run_config(tmp_path)
    trained_run(config, steps_after=0)
    saved = torch.load(ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1), weights_only=True)
    for no_load_lr_state, steps in ((False, 2), (True, 0)):
        model, optimizer, scheduler = build(config, seed=31)
        ckpt.load_checkpoint(model, optimizer, scheduler,
                             run_config(tmp_path, no_load_lr_state=no_load_lr_state))
        assert scheduler.num_steps == steps  # 0: warmup starts again
        # The optimizer's moments are loaded either way.
        moments = optimizer.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(moments, saved["optimizer"]["state"][0]["exp_avg"])


def test_no_load_optim_refreshes_mixed_precision_main_params(tmp_path):
    config = run_config(tmp_path, precision="bf16")
    saved, _, _, _ = trained_run(config, steps_after=0)
    model, optimizer, scheduler = build(config, seed=31)
    ckpt.load_checkpoint(model, optimizer, scheduler, run_config(tmp_path, precision="bf16",
                                                                 no_load_optim=True))
    mains = [m for group in optimizer.main_groups for m in group]
    models = [p for group in optimizer.model_groups for p in group]
    for main, param in zip(mains, models):
        assert torch.equal(main.data.to(param.dtype), param.data)
    assert_params_equal(params(model), saved)


def _failing_torch_save(real_save, fail_on_call: int):
    """torch.save that writes half a file and raises on call ``fail_on_call`` (1-based)."""
    calls = []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) < fail_on_call:
            return real_save(obj, f, *args, **kwargs)
        real_save({"partial": torch.zeros(1000)}, f)
        f.truncate(f.tell() // 2)
        raise OSError("disk full (simulated)")

    return save


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    config = run_config(tmp_path)
    saved, _, _, _ = trained_run(config, steps_after=1)
    model, optimizer, scheduler = build(config, seed=31)
    monkeypatch.setattr(torch, "save", _failing_torch_save(torch.save, 1))
    with pytest.raises(ckpt.CheckpointError, match="disk full.*previous checkpoint"):
        ckpt.save_checkpoint(4, model, optimizer, scheduler, config, consumed_train_samples=8)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert ckpt.read_tracker(str(tmp_path)).iteration == 2
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler, config)
    assert loaded.iteration == 2
    assert_params_equal(params(model), saved)


def test_crash_before_tracker_update_keeps_previous(tmp_path, monkeypatch):
    """A process killed after the rename but before the tracker (or before the temporary
    folder could be removed) leaves folders that loading ignores."""
    config = run_config(tmp_path)
    saved, _, _, _ = trained_run(config, steps_after=1)
    model, optimizer, scheduler = build(config, seed=31)
    real_write = ckpt.folder.write_text_atomic

    def no_tracker(path, text):
        if path.endswith(ckpt.TRACKER_FILENAME):
            raise KeyboardInterrupt("killed")
        real_write(path, text)

    monkeypatch.setattr(ckpt.folder, "write_text_atomic", no_tracker)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(4, model, optimizer, scheduler, config, consumed_train_samples=8)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # a kill leaves the tmp
    monkeypatch.setattr(torch, "save", _failing_torch_save(torch.save, 1))
    with pytest.raises(ckpt.CheckpointError):
        ckpt.save_checkpoint(6, model, optimizer, scheduler, config, consumed_train_samples=12)
    monkeypatch.undo()
    names = sorted(os.listdir(tmp_path))
    assert names[:2] == ["iter_0000002", "iter_0000004"]
    assert names[2].startswith("iter_0000006.tmp-")
    assert ckpt.list_iterations(str(tmp_path)) == [2, 4]
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler, config)
    assert loaded.iteration == 2
    assert_params_equal(params(model), saved)


def test_next_save_removes_folders_of_killed_saves(tmp_path, monkeypatch):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    old_tmp = tmp_path / "iter_0000004.tmp-ab12cd34"
    old_backup = tmp_path / "iter_0000002.old-0f0f0f0f"
    fresh_tmp = tmp_path / "iter_0000006.tmp-99999999"  # as if another run were saving now
    other = tmp_path / "iter_0000004.tmp-notes.txt"
    for folder in (old_tmp, old_backup, fresh_tmp):
        (folder / "mp_rank_00").mkdir(parents=True)
    other.write_text("a file, not a folder: kept")
    start = time.time()
    for folder in (old_tmp, old_backup):
        os.utime(folder, (start - 60, start - 60))
    monkeypatch.setattr(ckpt.retention, "_PROCESS_START", start - 30)
    ckpt.save_checkpoint(8, model, optimizer, scheduler, config, consumed_train_samples=16)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000004.tmp-notes.txt", "iter_0000006.tmp-99999999", "iter_0000008",
        "latest_checkpointed_iteration.txt"]


def test_saving_an_iteration_again_replaces_it(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    ckpt.save_checkpoint(3, model, optimizer, scheduler, config, consumed_train_samples=6)
    train_step(model, optimizer, scheduler, batch(0))
    after = params(model)
    ckpt.save_checkpoint(3, model, optimizer, scheduler, config, consumed_train_samples=6)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    model2, optimizer2, scheduler2 = build(config, seed=31)
    ckpt.load_checkpoint(model2, optimizer2, scheduler2, config)
    assert_params_equal(params(model2), after)


def test_corrupt_file_error_names_the_file(tmp_path):
    """A damaged file of a checkpoint without a manifest (an older save) is named by the read
    (with one, verification names it first: tests/unit/test_checkpoint_manifest.py)."""
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    ckpt.save_checkpoint(5, model, optimizer, scheduler, config, consumed_train_samples=10)
    os.remove(tmp_path / "iter_0000005" / "manifest.json")
    path = ckpt.checkpoint_path(str(tmp_path), 5, 0, 0, 1)
    data = open(path, "rb").read()
    for damaged in (data[: len(data) // 2], b"\x00garbage" * 10):
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint file") as info:
            ckpt.load_checkpoint(model, optimizer, scheduler, config)
        assert path in str(info.value)
    os.remove(path)
    with pytest.raises(ckpt.CheckpointError, match="does not exist") as info:
        ckpt.load_checkpoint(model, optimizer, scheduler, config)
    assert path in str(info.value)


def test_bad_tracker_and_missing_folder(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("12abc")
    with pytest.raises(ckpt.CheckpointError, match="latest_checkpointed_iteration.txt.*12abc"):
        ckpt.load_checkpoint(model, optimizer, scheduler, config)
    tracker.write_text("12")
    with pytest.raises(ckpt.CheckpointError, match="iter_0000012 does not exist"):
        ckpt.load_checkpoint(model, optimizer, scheduler, config)


def test_layout_mismatch_names_both_layouts(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    ckpt.save_checkpoint(5, model, optimizer, scheduler, config, consumed_train_samples=10)
    # What a tp=2, pp=2 save leaves (the real tp=2 save is in the distributed tests).
    iter_dir = tmp_path / "iter_0000005"
    for name in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        (iter_dir / name).mkdir()
    os.replace(iter_dir / "mp_rank_00" / "model_optim_rng.pt",
               iter_dir / "mp_rank_00_000" / "model_optim_rng.pt")
    os.rmdir(iter_dir / "mp_rank_00")
    # Without a manifest (Megatron-LM's folders) the layout is told from the folder names.
    (iter_dir / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointLayoutError) as info:
        ckpt.load_checkpoint(model, optimizer, scheduler, config)
    message = str(info.value)
    assert "tp=2, pp=2" in message and "tp=1, pp=1" in message
    assert "saved with" in message and "tools/checkpoint/convert.py" in message
    # The converter command is runnable as printed: real paths and this run's sizes.
    assert (f"`python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver "
            f"megatron --load-dir {tmp_path} --save-dir {tmp_path}_tp1_pp1 "
            "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1`, then --load "
            f"{tmp_path}_tp1_pp1") in message
    assert (Path(__file__).resolve().parents[2] / "tools" / "checkpoint" / "convert.py").is_file()


def test_virtual_pipeline_chunks(tmp_path):
    config = run_config(tmp_path)
    model_parallel_seed(3)
    chunks = [GPTModel(config.model, post_process=False, num_layers=1),
              GPTModel(config.model, pre_process=False, first_layer=1, num_layers=1)]
    optimizer = get_megatron_optimizer(config.optimizer, chunks)
    ckpt.save_checkpoint(2, chunks, optimizer, None, config, consumed_train_samples=4)
    state = torch.load(ckpt.checkpoint_path(str(tmp_path), 2, 0, 0, 1), weights_only=True)
    assert "model" not in state and {"model0", "model1"} <= state.keys()
    model_parallel_seed(4)
    fresh = [GPTModel(config.model, post_process=False, num_layers=1),
             GPTModel(config.model, pre_process=False, first_layer=1, num_layers=1)]
    ckpt.load_checkpoint(fresh, get_megatron_optimizer(config.optimizer, fresh), None, config)
    for a, b in zip(chunks, fresh):
        assert_params_equal(params(a), params(b))
    with pytest.raises(ckpt.CheckpointLayoutError, match="2 model chunk.*this run has 1"):
        ckpt.load_checkpoint([fresh[0]], None, None, run_config(tmp_path, no_load_optim=True))


def test_model_shape_mismatch_names_the_file(tmp_path):
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    ckpt.save_checkpoint(1, model, optimizer, scheduler, config, consumed_train_samples=2)
    model_parallel_seed(1)
    other = GPTModel(config.model.replace(hidden_size=64))
    with pytest.raises(ckpt.CheckpointError, match="mp_rank_00/model_optim_rng.pt.*'model'"):
        ckpt.load_checkpoint(other, None, None, config)


def test_keep_last_n_and_best(tmp_path):
    config = run_config(tmp_path, keep_last_n_checkpoints=2, save_best=True)
    model, optimizer, scheduler = build(config)
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 6.0, 5: 7.0}
    for it, valid_loss in losses.items():
        ckpt.save_checkpoint(it, model, optimizer, scheduler, config,
                             consumed_train_samples=2 * it, valid_loss=valid_loss)
    assert ckpt.list_iterations(str(tmp_path)) == [2, 4, 5]
    assert ckpt.read_best(str(tmp_path)) == (2, 3.0)
    assert not ckpt.update_best_checkpoint(str(tmp_path), 5, 3.5)
    assert ckpt.update_best_checkpoint(str(tmp_path), 5, 1.0)
    assert ckpt.read_best(str(tmp_path)) == (5, 1.0)
    with pytest.raises(ckpt.CheckpointError, match="iter_0000003 does not exist"):
        ckpt.update_best_checkpoint(str(tmp_path), 3, 0.5)
    # The tracker's checkpoint is never pruned, even when it is not among the newest.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    assert ckpt.prune_checkpoints(str(tmp_path), 1) == [4]
    assert ckpt.list_iterations(str(tmp_path)) == [2, 5]


def test_keep_last_n_without_best(tmp_path):
    config = run_config(tmp_path, keep_last_n_checkpoints=1)
    model, optimizer, scheduler = build(config)
    for it in (10, 20, 30):
        ckpt.save_checkpoint(it, model, optimizer, scheduler, config,
                             consumed_train_samples=it, valid_loss=1.0)
    assert ckpt.list_iterations(str(tmp_path)) == [30]
    assert ckpt.read_best(str(tmp_path)) is None  # --save-best is off


def test_reads_megatron_deepspeed_style_checkpoint(tmp_path):
    """A Megatron-DeepSpeed file: argparse Namespace under 'args', raw RNG tuples/arrays."""
    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    random.seed(3)
    np.random.seed(3)
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           get_rng_tracker().get_states())
    expected = side_draws()
    state = {
        "args": argparse.Namespace(consumed_train_samples=64, consumed_valid_samples=8,
                                   tensor_model_parallel_size=1, params_dtype=torch.float32),
        "checkpoint_version": 3.0, "iteration": 7, "model": model.state_dict(),
        "random_rng_state": rng[0], "np_rng_state": rng[1], "torch_rng_state": rng[2],
        "cuda_rng_state": None, "rng_tracker_states": rng[3], "tokens": 1024,
    }
    os.makedirs(tmp_path / "iter_0000007" / "mp_rank_00")
    torch.save(state, ckpt.checkpoint_path(str(tmp_path), 7, 0, 0, 1))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    scramble_rngs()
    loaded = ckpt.load_checkpoint(model, optimizer, scheduler,
                                  run_config(tmp_path, no_load_optim=True))
    assert tuple(loaded) == (7, 64, 8)
    assert side_draws() == expected
    assert ckpt.load_checkpoint_config(str(tmp_path))["consumed_train_samples"] == 64

"""Checkpoints on real gloo ranks: tensor/pipeline-sharded folders, failures on one rank, and
the distributed optimizer's state moving between data-parallel sizes.

One spawn of 2 ranks runs every multi-rank scenario (spawning is the slow part); the
single-process halves (dp=1 save/load, loading at the wrong layout) run in this process.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import zlib

import pytest
import torch
import torch.distributed as dist

from megatron import checkpointing as ckpt
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import DistributedOptimizer, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_seed
from megatron.model.gpt_model import GPTModel
from tests.checkpoint_utils import flip_bytes
from tests.dist_utils import run_distributed
from tests.unit.test_checkpointing import (
    assert_params_equal,
    batch,
    build_scheduler,
    params,
    run_config,
    scramble_rngs,
    train_step,
)

GLOBAL_BATCH = 4
STEPS_BEFORE, STEPS_AFTER = 2, 2


# Tensor parallel: two mp_rank folders, bit-identical resumption, one rank failing ------------


def _tensor_parallel(rank: int, root: str) -> dict:
    parallel_state.initialize_model_parallel(2, 1)
    config = run_config(os.path.join(root, "tp2"), tp=2, world_size=2)

    def build(seed):
        model_parallel_seed(seed)
        model = GPTModel(config.model)
        optimizer = get_megatron_optimizer(config.optimizer, [model])
        return model, optimizer, build_scheduler(optimizer)

    model, optimizer, scheduler = build(5)
    for step in range(STEPS_BEFORE):
        train_step(model, optimizer, scheduler, batch(step))
    ckpt.save_checkpoint(STEPS_BEFORE, [model], optimizer, scheduler, config,
                         consumed_train_samples=8)
    failure = _save_failing_on_rank1(rank, model, optimizer, scheduler, config)
    reference = [train_step(model, optimizer, scheduler, batch(STEPS_BEFORE + i))
                 for i in range(3)]
    reference_params = params(model)

    model, optimizer, scheduler = build(77)
    scramble_rngs(99 + rank)
    loaded = ckpt.load_checkpoint([model], optimizer, scheduler, config)
    resumed = [train_step(model, optimizer, scheduler, batch(STEPS_BEFORE + i)) for i in range(3)]
    assert_params_equal(params(model), reference_params)
    damaged = _load_with_rank1_file_damaged(rank, root, config, build)
    parallel_state.destroy_model_parallel()
    return {"reference": reference, "resumed": resumed, "loaded": tuple(loaded),
            "failure": failure, "folders": sorted(os.listdir(os.path.join(root, "tp2"))),
            "damaged": damaged}


def _load_with_rank1_file_damaged(rank, root, config, build) -> str:
    """A copy of the tp2 checkpoint with bytes flipped in mp_rank_01's file: tensor rank 1
    names it, tensor rank 0 (whose file is intact) fails too, and no rank loads anything."""
    copy = os.path.join(root, "tp2-damaged")
    if rank == 0:
        shutil.copytree(os.path.join(root, "tp2"), copy)
        flip_bytes(ckpt.checkpoint_path(copy, STEPS_BEFORE, 1, 0, 1))
    dist.barrier()
    model, optimizer, scheduler = build(78)
    damaged = config.replace(checkpoint=dataclasses.replace(config.checkpoint, load=copy))
    try:
        ckpt.load_checkpoint([model], optimizer, scheduler, damaged)
    except ckpt.CheckpointError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _save_failing_on_rank1(rank, model, optimizer, scheduler, config) -> str:
    """Save iteration 3 with rank 1's write failing; every rank must raise."""
    real_save = torch.save

    def failing_save(*args, **kwargs):
        raise OSError("disk full on rank 1 (simulated)")

    if rank == 1:
        torch.save = failing_save
    try:
        ckpt.save_checkpoint(3, [model], optimizer, scheduler, config, consumed_train_samples=12)
    except ckpt.CheckpointError as error:
        return str(error)
    finally:
        torch.save = real_save
    return "no error"


# Pipeline parallel: mp_rank_XX_YYY folders ----------------------------------------------------


def _pipeline_parallel(rank: int, root: str) -> dict:
    parallel_state.initialize_model_parallel(1, 2)
    config = run_config(os.path.join(root, "pp2"), pp=2, world_size=2)

    def build(seed):
        model_parallel_seed(seed)
        return GPTModel(config.model, pre_process=rank == 0, post_process=rank == 1,
                        first_layer=rank, num_layers=1)

    model = build(5)
    optimizer = get_megatron_optimizer(config.optimizer, [model])
    ckpt.save_checkpoint(4, [model], optimizer, None, config, consumed_train_samples=8)
    fresh = build(6)
    loaded = ckpt.load_checkpoint([fresh], get_megatron_optimizer(config.optimizer, [fresh]),
                                  None, config)
    assert_params_equal(params(fresh), params(model))
    parallel_state.destroy_model_parallel()
    return {"loaded": tuple(loaded),
            "folders": sorted(os.listdir(os.path.join(root, "pp2", "iter_0000004")))}


# Distributed optimizer: saved at one data-parallel size, continued at another -----------------


def build_distributed(config, seed: int = 5):
    model_parallel_seed(seed)
    model = DistributedDataParallel(GPTModel(config.model), use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config.optimizer, [model])
    assert isinstance(optimizer, DistributedOptimizer)
    return model, optimizer, build_scheduler(optimizer)


def ddp_step(model, optimizer, scheduler, step: int) -> float:
    """One step on this rank's rows of the global batch; returns the global-batch loss."""
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    rows = GLOBAL_BATCH // dp_size
    tokens = batch(step, GLOBAL_BATCH)[dp_rank * rows:(dp_rank + 1) * rows]
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    finalize_model_grads([model])
    optimizer.step()
    scheduler.step(GLOBAL_BATCH)
    loss = loss.detach()
    if dp_size > 1:
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / dp_size


def train_save_continue(config) -> tuple[list[float], dict]:
    """Train, save at STEPS_BEFORE, continue: the uninterrupted run's losses and weights."""
    model, optimizer, scheduler = build_distributed(config)
    for step in range(STEPS_BEFORE):
        ddp_step(model, optimizer, scheduler, step)
    ckpt.save_checkpoint(STEPS_BEFORE, [model], optimizer, scheduler, config,
                         consumed_train_samples=STEPS_BEFORE * GLOBAL_BATCH)
    losses = [ddp_step(model, optimizer, scheduler, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
    return losses, params(model)


def load_and_continue(config) -> tuple[tuple, list[float], dict]:
    model, optimizer, scheduler = build_distributed(config, seed=77)
    loaded = ckpt.load_checkpoint([model], optimizer, scheduler, config)
    losses = [ddp_step(model, optimizer, scheduler, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
    return tuple(loaded), losses, params(model)


def _distributed_optimizer(rank: int, root: str) -> dict:
    parallel_state.initialize_model_parallel(1, 1)
    save_config = run_config(os.path.join(root, "dp2"), world_size=2, dropout=0.0,
                             distributed_optimizer=True)
    reference, reference_params = train_save_continue(save_config)
    load_config = run_config(os.path.join(root, "dp1"), world_size=2, dropout=0.0,
                             distributed_optimizer=True)
    loaded, resumed, resumed_params = load_and_continue(load_config)
    parallel_state.destroy_model_parallel()
    folder = os.path.join(root, "dp2", "iter_0000002", "mp_rank_00")
    return {"reference": reference, "reference_params": _picklable(reference_params),
            "loaded": loaded, "resumed": resumed, "resumed_params": _picklable(resumed_params),
            "files": sorted(os.listdir(folder))}


def _streamed_and_background(rank: int, root: str) -> dict:
    """At dp 2 with small buckets (pieces of one parameter on both ranks): the distributed
    optimizer's file streamed to data-parallel rank 0 equals torch.save of the state gathered
    on every rank; a background save (AsyncSaver) is unpublished when save_checkpoint returns,
    training goes on meanwhile, and once waited for its files equal the synchronous save's."""
    from megatron.checkpointing.async_save import AsyncSaver

    parallel_state.initialize_model_parallel(1, 1)
    sync_config = run_config(os.path.join(root, "sync"), world_size=2, dropout=0.0,
                             distributed_optimizer=True)
    async_config = run_config(os.path.join(root, "async"), world_size=2, dropout=0.0,
                              distributed_optimizer=True)
    model_parallel_seed(5)
    model = DistributedDataParallel(GPTModel(sync_config.model), use_distributed_optimizer=True,
                                    bucket_size=3000)
    optimizer = get_megatron_optimizer(sync_config.optimizer, [model])
    scheduler = build_scheduler(optimizer)
    for step in range(STEPS_BEFORE):
        ddp_step(model, optimizer, scheduler, step)
    gathered = optimizer.gathered_state_dict()
    if rank == 0:  # a file object: torch.save names the archive after a path's file name
        with open(os.path.join(root, "gathered.pt"), "wb") as f:
            torch.save(gathered, f)
    del gathered
    ckpt.save_checkpoint(STEPS_BEFORE, [model], optimizer, scheduler, sync_config,
                         consumed_train_samples=STEPS_BEFORE * GLOBAL_BATCH)
    saver = AsyncSaver()
    # As the training loop does after its first step: the host memory is allocated in the
    # background, and the save copies into it without allocating any.
    ckpt.reserve_host_buffers(STEPS_BEFORE, [model], optimizer, scheduler, async_config, saver)
    ckpt.save_checkpoint(STEPS_BEFORE, [model], optimizer, scheduler, async_config,
                         consumed_train_samples=STEPS_BEFORE * GLOBAL_BATCH, saver=saver)
    fresh_buffers = saver.buffers.fresh
    unpublished = (saver.pending, ckpt.read_tracker(os.path.join(root, "async")))
    losses = [ddp_step(model, optimizer, scheduler, STEPS_BEFORE + i) for i in range(2)]
    folder = saver.wait()
    failures = _model_file_failing_on_rank0(rank, root, model, optimizer, scheduler, saver)
    parallel_state.destroy_model_parallel()
    return {"unpublished": unpublished, "folder": folder, "after": losses,
            "pending_after": saver.pending, "failures": failures, "fresh": fresh_buffers}


def _model_file_failing_on_rank0(rank, root, model, optimizer, scheduler, saver) -> list[str]:
    """Data-parallel rank 0's model file fails (a full disk) while rank 1 streams it its
    optimizer pieces: both ranks fail the save, now and in the background, without waiting
    for each other forever."""
    from megatron.checkpointing.formats.torch import save as save_module

    config = run_config(os.path.join(root, "failing"), world_size=2, dropout=0.0,
                        distributed_optimizer=True)
    real = save_module.write_torch

    def full_disk(obj, path):
        raise OSError(28, "No space left on device (simulated)")

    if rank == 0:
        save_module.write_torch = full_disk
    failures = []
    try:
        for background in (None, saver):
            try:
                ckpt.save_checkpoint(4, [model], optimizer, scheduler, config,
                                     consumed_train_samples=16, saver=background)
                if background is not None:
                    background.wait()
            except ckpt.CheckpointError as error:
                failures.append(str(error))
    finally:
        save_module.write_torch = real
    return failures


def _picklable(tensors: dict) -> dict:
    # Tensors sent back from a rank travel as shared-memory handles that die with the rank
    # process (ConnectionResetError in the parent); numpy arrays travel by value.
    return {name: t.numpy() for name, t in tensors.items()}


def _world2(rank: int, world_size: int, root: str) -> dict:
    return {"tp": _tensor_parallel(rank, root), "pp": _pipeline_parallel(rank, root),
            "dp": _distributed_optimizer(rank, root),
            "stream": _streamed_and_background(rank, root)}


# -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    dp1_config = run_config(os.path.join(root, "dp1"), dropout=0.0, distributed_optimizer=True)
    dp1_reference, dp1_params = train_save_continue(dp1_config)
    ranks = run_distributed(_world2, 2, root)
    dp2_config = run_config(os.path.join(root, "dp2"), dropout=0.0, distributed_optimizer=True)
    loaded, resumed, resumed_params = load_and_continue(dp2_config)
    return {"root": root, "ranks": ranks, "dp1_reference": dp1_reference, "dp1_params": dp1_params,
            "dp1_loaded": loaded, "dp1_resumed": resumed, "dp1_resumed_params": resumed_params}


def test_tensor_parallel_saves_one_folder_per_rank_and_resumes_exactly(runs):
    root = runs["root"]
    iter_dir = os.path.join(root, "tp2", "iter_0000002")
    assert sorted(os.listdir(iter_dir)) == ["manifest.json", "mp_rank_00", "mp_rank_01"]
    for tp_rank in (0, 1):
        assert os.path.isfile(ckpt.checkpoint_path(os.path.join(root, "tp2"), 2, tp_rank, 0, 1))
    for result in (r["tp"] for r in runs["ranks"]):
        assert result["loaded"] == (2, 8, 0)
        assert result["resumed"] == result["reference"]  # bit-identical, dropout on


def _assert_manifest_matches_folder(iter_dir: str, expected_files: list[str]) -> dict:
    manifest = ckpt.read_manifest(iter_dir)
    assert sorted(manifest["files"]) == expected_files
    for rel, entry in manifest["files"].items():
        data = open(os.path.join(iter_dir, rel), "rb").read()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, rel
    return manifest


def test_manifest_lists_the_files_every_rank_wrote(runs):
    root = runs["root"]
    tp2 = _assert_manifest_matches_folder(
        os.path.join(root, "tp2", "iter_0000002"),
        ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"])
    assert tp2["parallel_layout"]["tensor_model_parallel_size"] == 2
    assert tp2["config"]["parallel"]["tensor_model_parallel_size"] == 2
    pp2 = _assert_manifest_matches_folder(
        os.path.join(root, "pp2", "iter_0000004"),
        ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"])
    assert pp2["parallel_layout"]["pipeline_model_parallel_size"] == 2
    dp2 = _assert_manifest_matches_folder(
        os.path.join(root, "dp2", "iter_0000002"),
        ["mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"])
    assert dp2["parallel_layout"]["data_parallel_size"] == 2


def test_a_damaged_file_of_one_rank_fails_the_load_on_every_rank(runs):
    messages = [r["tp"]["damaged"] for r in runs["ranks"]]
    damaged = os.path.join(runs["root"], "tp2-damaged", "iter_0000002", "mp_rank_01",
                           "model_optim_rng.pt")
    assert messages[1].startswith("CheckpointCorruptError: checkpoint file " + damaged +
                                  " is damaged: its CRC-32 is"), messages[1]
    # Rank 0 (which prints for all) names rank 1's file and what is wrong with it.
    assert messages[0].startswith(f"CheckpointError: on rank 1: checkpoint file {damaged} is "
                                  "damaged: its CRC-32 is"), messages[0]


def test_a_failing_rank_fails_the_whole_save(runs):
    messages = [r["tp"]["failure"] for r in runs["ranks"]]
    assert "disk full on rank 1" in messages[1]
    # Rank 0 speaks for all: its message names the failing rank and the real cause.
    assert "on rank 1: disk full on rank 1" in messages[0]
    assert runs["ranks"][0]["tp"]["folders"] == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_pipeline_parallel_folder_names(runs):
    for result in (r["pp"] for r in runs["ranks"]):
        assert result["folders"] == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001"]
        assert result["loaded"] == (4, 8, 0)


def test_loading_at_another_tensor_parallel_size_names_both_layouts(runs):
    config = run_config(os.path.join(runs["root"], "tp2"))
    model_parallel_seed(1)
    model = GPTModel(config.model)
    with pytest.raises(ckpt.CheckpointLayoutError) as info:
        ckpt.load_checkpoint(model, None, None, config)
    message = str(info.value)
    assert "tp=2, pp=1" in message and "tp=1, pp=1" in message
    assert "saved with" in message and "tools/checkpoint/convert.py" in message


def _assert_close(got: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def _assert_params_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(torch.as_tensor(got[name]), torch.as_tensor(expected[name]),
                                   rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_distributed_optimizer_saved_at_dp2_continues_at_dp1(runs):
    dp2 = runs["ranks"][0]["dp"]
    assert dp2["files"] == ["distrib_optim.pt", "model_optim_rng.pt"]
    assert runs["dp1_loaded"] == (STEPS_BEFORE, STEPS_BEFORE * GLOBAL_BATCH, 0)
    _assert_close(runs["dp1_resumed"], dp2["reference"])
    _assert_params_close(runs["dp1_resumed_params"], dp2["reference_params"])


def test_distributed_optimizer_saved_at_dp1_continues_at_dp2(runs):
    for result in (r["dp"] for r in runs["ranks"]):
        assert result["loaded"] == (STEPS_BEFORE, STEPS_BEFORE * GLOBAL_BATCH, 0)
        _assert_close(result["resumed"], runs["dp1_reference"])
        _assert_params_close(result["resumed_params"], runs["dp1_params"])


def test_distributed_optimizer_checkpoint_without_its_state(runs):
    """--no-load-optim refreshes the fp32 main shards from the loaded weights; a run without
    --use-distributed-optimizer is told why it cannot load the optimizer state."""
    config = run_config(os.path.join(runs["root"], "dp2"), dropout=0.0,
                        distributed_optimizer=True, no_load_optim=True)
    model, optimizer, scheduler = build_distributed(config, seed=77)
    assert ckpt.load_checkpoint([model], optimizer, scheduler, config).iteration == STEPS_BEFORE
    for shard in optimizer.shards:
        flat = shard.model_param.detach().reshape(-1)[shard.param_lo:shard.param_hi]
        assert torch.equal(shard.main.data, flat.float())
    plain = run_config(os.path.join(runs["root"], "dp2"), dropout=0.0)
    model_parallel_seed(3)
    model = GPTModel(plain.model)
    optimizer = get_megatron_optimizer(plain.optimizer, [model])
    with pytest.raises(ckpt.CheckpointError, match="saved with --use-distributed-optimizer"):
        ckpt.load_checkpoint(model, optimizer, build_scheduler(optimizer), plain)


def test_optimizer_state_streams_to_rank0_and_background_saves_equal_synchronous_ones(runs):
    root = runs["root"]
    gathered = open(os.path.join(root, "gathered.pt"), "rb").read()
    sync = os.path.join(root, "sync", "iter_0000002")
    background = os.path.join(root, "async", "iter_0000002")
    data = open(os.path.join(sync, "mp_rank_00", "distrib_optim.pt"), "rb").read()
    assert data == gathered  # byte for byte: the same file torch.save writes
    assert open(os.path.join(background, "mp_rank_00", "distrib_optim.pt"), "rb").read() == data
    written, expected = (torch.load(os.path.join(folder, "mp_rank_00", "model_optim_rng.pt"),
                                    weights_only=True) for folder in (background, sync))
    for state in (written, expected):  # the one difference: where each was saved
        state["config"]["checkpoint"].update(save=None, load=None)
    assert written.keys() == expected.keys()
    for key in written:
        if key == "model":
            assert_params_equal(written[key], expected[key])
        elif key != "rng_state":  # generator states: tensors, compared below
            assert written[key] == expected[key], key
    for got, want in zip(written["rng_state"], expected["rng_state"]):
        assert torch.equal(got["torch_rng_state"], want["torch_rng_state"])
    _assert_manifest_matches_folder(background, ["mp_rank_00/distrib_optim.pt",
                                                 "mp_rank_00/model_optim_rng.pt"])
    assert ckpt.read_tracker(os.path.join(root, "async")).iteration == 2
    for result in (r["stream"] for r in runs["ranks"]):
        assert result["unpublished"] == (2, None)  # written behind the returned call
        assert result["fresh"] == 0  # every copy went into the reserved buffers
        assert result["folder"] == background and result["pending_after"] is None
        # the steps taken while it was written are the uninterrupted run's
        assert result["after"] == runs["ranks"][0]["dp"]["reference"][:2]
    rank0, rank1 = (r["stream"]["failures"] for r in runs["ranks"])
    assert len(rank0) == len(rank1) == 2  # the synchronous save, then the background one
    # Rank 1 (which wrote its pieces fine) names rank 0 and its error, as rank 0 does.
    assert all("failed on rank 0: [Errno 28] No space left on device" in m
               for m in rank0 + rank1)
    assert os.listdir(os.path.join(root, "failing")) == []  # nothing published, nothing left


@pytest.mark.parametrize("damage", ["truncated", "flipped", "truncated-unverified"])
def test_corrupt_distributed_optimizer_file_names_it(runs, tmp_path, damage):
    shutil.copytree(os.path.join(runs["root"], "dp2"), tmp_path / "dp2")
    path = str(tmp_path / "dp2" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt")
    if damage == "flipped":
        flip_bytes(path)
        expected = "is damaged: its CRC-32 is"
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 3)
        expected = "is damaged: it has"
    if damage == "truncated-unverified":  # a save from before manifests: the read names it
        os.remove(tmp_path / "dp2" / "iter_0000002" / "manifest.json")
        expected = "cannot read checkpoint file"
    config = run_config(tmp_path / "dp2", dropout=0.0, distributed_optimizer=True)
    model, optimizer, scheduler = build_distributed(config)
    before = params(model)
    with pytest.raises(ckpt.CheckpointError, match=expected) as info:
        ckpt.load_checkpoint([model], optimizer, scheduler, config)
    assert path in str(info.value)
    assert_params_equal(params(model), before)

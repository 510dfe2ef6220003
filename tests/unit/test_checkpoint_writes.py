"""Writing checkpoint files (megatron/checkpointing/files.py, lock.py) in one process: a file
streamed tensor by tensor is the file torch.save writes; a full disk or the file size limit
is named with the file, the bytes needed and free, and leaves no partial file; the --save
lock refuses a live holder and takes over a dead one's, even where processes the dead one
started still hold its flock."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megatron.checkpointing import CheckpointError
from megatron.checkpointing import lock as lock_module
from megatron.checkpointing.files import (
    Deferred,
    read_torch,
    write_text_atomic,
    write_torch,
    write_torch_streamed,
)
from megatron.checkpointing.lock import LOCK_FILENAME, SaveLock
from tests.checkpoint_utils import small_tmpfs


def _state(values):
    return {"format": "x", "param_state": [{"w": {"param": values[0], "exp_avg": values[1]}},
                                            {"b": {"param": values[2]}}],
            "step": 3.0, "grad_scaler": {"scale": torch.tensor([2.0**16])}}


def test_a_streamed_file_is_the_file_torch_save_writes(tmp_path):
    values = [torch.randn(7, 5), torch.randn(7, 5), torch.randn(11)]
    deferred = [Deferred(i, tuple(v.shape)) for i, v in enumerate(values)]
    drawn = []

    def tensors():
        for v in values:
            drawn.append(v)
            yield v

    streamed = write_torch_streamed(_state(deferred), str(tmp_path / "s.pt"), deferred,
                                    tensors())
    whole = write_torch(_state(values), str(tmp_path / "w.pt"))
    assert (tmp_path / "s.pt").read_bytes() == (tmp_path / "w.pt").read_bytes()
    assert streamed == whole and len(drawn) == 3
    loaded = read_torch(str(tmp_path / "s.pt"), mmap=True)
    assert torch.equal(loaded["param_state"][0]["w"]["exp_avg"], values[1])


def test_full_disk_names_the_file_and_the_space_and_leaves_nothing(tmp_path):
    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:
        path = os.path.join(disk, "model_optim_rng.pt")
        with pytest.raises(CheckpointError) as info:
            write_torch({"w": torch.zeros(1 << 19)}, path)  # 2 MiB into 1 MiB
        message = str(info.value)
        assert message.startswith(f"cannot write {path}: no space left on device "
                                  f"({1 << 21} bytes needed, ")
        assert message.endswith(f" free in {disk})")
        free = int(message.split(", ")[1].split()[0])
        assert 0.9 * (1 << 20) < free <= 1 << 20  # the partial file was removed first
        assert os.listdir(disk) == []

        deferred = [Deferred(0, (1 << 18,)), Deferred(1, (1 << 18,))]
        drawn = []

        def tensors():
            for _ in deferred:
                drawn.append(1)
                yield torch.ones(1 << 18)

        with pytest.raises(CheckpointError, match="no space left on device"):
            write_torch_streamed({"a": deferred[0], "b": deferred[1]},
                                 os.path.join(disk, "distrib_optim.pt"), deferred, tensors())
        assert len(drawn) == 2  # drawn to the end: the other ranks' sends complete
        assert os.listdir(disk) == []

        with open(os.path.join(disk, "filler"), "wb") as f:
            f.write(b"\0" * ((1 << 20) - 4096))
        with pytest.raises(CheckpointError, match="no space left on device"):
            write_text_atomic(os.path.join(disk, "latest_checkpointed_iteration.txt"), "1" * 9000)
        assert os.listdir(disk) == ["filler"]  # no latest_checkpointed_iteration.txt.tmp-*


def test_full_disk_under_torch_distributed_checkpoint_names_the_file(tmp_path):
    """DCP (--ckpt-format torch_dist) reports a failed write as torch's writer's complaint
    ("unexpected pos ..."), hiding the full disk; the error names the file and the space."""
    from megatron.checkpointing.formats.torch_dist import dcp

    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:
        folder = os.path.join(disk, "iter_0000001")
        os.makedirs(folder)
        pieces = [dcp.Piece(f"w{i}", (1 << 17,), (0,), torch.ones(1 << 17)) for i in range(4)]
        with pytest.raises(CheckpointError) as info:
            dcp.write_pieces(folder, pieces, {"obj": b"x" * 100})  # 2 MiB into 1 MiB
        message = str(info.value)
        assert message.startswith(f"cannot write {folder}/__0_0.distcp: no space left on "
                                  f"device ({(1 << 21) + 100} bytes needed, "), message
        assert message.endswith(f" free in {folder})")


def test_file_size_limit_is_named(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(CheckpointError, match=r"file size limit .*ulimit -f"):
            write_torch({"w": torch.zeros(1 << 19)}, str(tmp_path / "big.pt"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == []


HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from megatron.checkpointing.lock import SaveLock
    SaveLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path, caplog):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=repo), str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(CheckpointError) as info:
            SaveLock(str(tmp_path)).acquire()
        message = str(info.value)
        assert message.startswith(f"--save {tmp_path} is in use by another run (host ")
        assert f"pid {holder.pid}, started 20" in message and "give this run another --save" \
            in message
    finally:
        holder.kill()  # SIGKILL: the lock file stays, its flock goes with the process
        holder.wait()
    assert os.path.isfile(tmp_path / LOCK_FILENAME)
    lock = SaveLock(str(tmp_path))
    stale = lock.acquire()
    assert stale is not None and stale.pid == holder.pid
    assert f"took over the lock of a run that is gone (host {stale.host}, pid {holder.pid}" \
        in caplog.text
    again = SaveLock(str(tmp_path))  # a later run in this process (the first one crashed)
    assert again.acquire() is None
    again.release()
    lock.release()
    assert not os.path.exists(tmp_path / LOCK_FILENAME)


def test_a_background_save_refuses_nan_on_its_copy_and_publishes_nothing(tmp_path):
    """What --async-save does instead of checking the live state before saving: the writer
    checks its host copy, so the loop does not wait for the scan."""
    from megatron import checkpointing as ckpt
    from megatron.checkpointing.async_save import AsyncSaver
    from tests.unit.test_checkpointing import build, run_config

    config = run_config(tmp_path)
    model, optimizer, scheduler = build(config)
    saver = AsyncSaver()
    ckpt.save_checkpoint(1, model, optimizer, scheduler, config, consumed_train_samples=2,
                         saver=saver, refuse_nonfinite=True)
    assert saver.wait() == str(tmp_path / "iter_0000001")
    with torch.no_grad():
        model.final_layernorm.weight[3] = float("nan")
    ckpt.save_checkpoint(2, model, optimizer, scheduler, config, consumed_train_samples=4,
                         saver=saver, refuse_nonfinite=True)
    with torch.no_grad():
        model.final_layernorm.weight[3] = 1.0  # training changed it meanwhile
    with pytest.raises(CheckpointError, match=r"refusing to save the checkpoint of iteration 2: "
                       r"model\.final_layernorm\.weight holds NaN/Inf; the tracker"):
        saver.wait()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A run's rank 0 as torchrun saw it: it holds the lock, then forks a child (a DataLoader
# worker) that outlives it.
FORKING_HOLDER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from megatron.checkpointing.lock import SaveLock
    SaveLock(sys.argv[1]).acquire()
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    sys.stdin.read()
""")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_lock_is_not_kept_by_the_holders_forked_children(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER.format(repo=REPO),
                               str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(CheckpointError):  # the child closing its copy freed nothing
            SaveLock(str(tmp_path)).acquire()
        holder.kill()
        holder.wait()
        start = time.monotonic()
        lock = SaveLock(str(tmp_path))
        stale = lock.acquire()  # the child is still there: it must not hold the lock
        took = time.monotonic() - start
    finally:
        _kill(child)
        holder.kill()
        holder.wait()
    assert stale is not None and stale.pid == holder.pid
    assert took < lock_module._ORPHAN_GRACE  # at once: no wait for orphans
    assert "processes it started still held it" not in caplog.text
    lock.release()


# Holds the flock of the lock file in whatever form it is, naming a process that is gone
# (the children of a holder that predates the fork rule); after ``rename`` seconds it writes
# its own name there, as a run that has just taken the flock does.
ORPHAN = textwrap.dedent("""
    import fcntl, json, os, sys, time
    path, dead, rename = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    def name(pid):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({{"host": {host!r}, "pid": pid, "started": "2024"}}).encode(), 0)
    name(dead)
    print("held", flush=True)
    if rename >= 0:
        time.sleep(rename)
        name(os.getpid())
    sys.stdin.read()
""")


def _orphan(tmp_path, rename: float) -> tuple[subprocess.Popen, int]:
    import socket

    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = subprocess.Popen(
        [sys.executable, "-c", ORPHAN.format(host=socket.gethostname()),
         str(tmp_path / LOCK_FILENAME), str(gone.pid), str(rename)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert orphan.stdout.readline() == "held\n"
    return orphan, gone.pid


def test_a_dead_holders_lock_still_flocked_by_its_children_is_taken_over(tmp_path, caplog):
    orphan, dead = _orphan(tmp_path, rename=-1)
    try:
        start = time.monotonic()
        lock = SaveLock(str(tmp_path))
        stale = lock.acquire()
        took = time.monotonic() - start
        assert stale is not None and stale.pid == dead
        assert lock_module._ORPHAN_GRACE <= took < lock_module._ORPHAN_GRACE + 5
        assert (f"took over the lock of a run that is gone (host {stale.host}, pid {dead}, "
                "started 2024); processes it started still held it") in caplog.text
        written = json.loads((tmp_path / LOCK_FILENAME).read_text())
        assert written["pid"] == os.getpid()
        # A third run finds this one alive (the orphan's flock is on the replaced file).
        third = subprocess.run([sys.executable, "-c", HOLDER.format(repo=REPO), str(tmp_path)],
                               input="", capture_output=True, text=True, timeout=60)
        assert third.returncode == 1
        assert f"is in use by another run (host {stale.host}, pid {os.getpid()}" in third.stderr
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILENAME]  # no temporary file left
    finally:
        orphan.kill()
        orphan.wait()
    lock.release()
    assert not os.path.exists(tmp_path / LOCK_FILENAME)


def test_a_run_that_names_itself_during_the_wait_is_refused(tmp_path):
    orphan, _ = _orphan(tmp_path, rename=0.5)
    try:
        with pytest.raises(CheckpointError) as info:
            SaveLock(str(tmp_path)).acquire()
        assert "is in use by another run (host " in str(info.value)
        assert f"pid {orphan.pid}, started 2024" in str(info.value)
    finally:
        orphan.kill()
        orphan.wait()

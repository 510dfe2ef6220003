"""Writing a checkpoint, now or in the background (``--async-save``), for any format.

A save is a ``SaveJob``: started by every rank together (which takes what it writes: with
``--async-save`` a host copy of this rank's tensors), then ``write()`` puts this rank's files
into the save's temporary folder, then global rank 0 ``publish()``-es the folder (manifest,
rename, tracker) once every rank's write has succeeded, or ``abandon()``-s it when any failed.
The torch format's job is in save.py; another format (torch_dist) brings its own.

``finish_save`` is the end both ways share (collective, main thread): the ranks vote on their
writes, the digests go to rank 0, rank 0 publishes, and every rank learns the outcome; a
failure anywhere raises ``CheckpointError`` on every rank, naming the lowest failing rank and
its error (for a full disk: the file, the bytes needed and free).

``AsyncSaver`` runs one job's ``write()`` in a thread while training goes on, from host
copies taken into its ``HostBuffers`` (reused from save to save). The loop calls
``poll()`` after each iteration (one small all-reduce while a save is pending; the save is
published the iteration all ranks have finished writing), and ``wait()`` before the next save
and before the process ends (the last save, ``--exit-interval``, ``--exit-duration-in-mins``,
SIGTERM), so a save that was started is published, or fails the run loudly, before exit. A
write runs no collective on the training's process groups: what it sends (the distributed
optimizer's pieces) goes over the saver's own gloo group.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import NoReturn, Optional, Protocol

import torch
import torch.distributed as dist

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import FileDigest
from megatron.checkpointing.ranks import all_true, first_failure, gather_to_all

logger = logging.getLogger(__name__)


class SaveJob(Protocol):
    """One started save (see the module docstring)."""

    iteration: int
    save_dir: str
    folder: str  # where the checkpoint will be once published

    def write(self) -> dict[str, FileDigest]:
        """This rank's files, written into the temporary folder; their digests by path
        relative to the iteration folder. May run in a background thread."""

    def publish(self, digests: dict[str, FileDigest]) -> None:
        """Global rank 0, once every rank has written: the manifest of ``digests`` (every
        rank's), the folder renamed into place, the tracker moved."""

    def abandon(self) -> None:
        """Global rank 0, when a rank failed: remove what the save wrote."""


def finish_save(job: SaveJob, error: Optional[BaseException],
                digests: dict[str, FileDigest]) -> str:
    """Publish ``job`` if every rank's write succeeded (``error`` is this rank's); raise
    ``CheckpointError`` on every rank otherwise. Collective over all ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not all_true(error is None):
        if rank == 0:
            job.abandon()
        _raise_failure(job, error, rank)
    merged: dict[str, FileDigest] = {}
    for part in gather_to_all(digests):
        merged.update(part)
    error = None
    if rank == 0:
        try:
            job.publish(merged)
        except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
            error = e
    if not all_true(error is None):
        _raise_failure(job, error, rank)
    logger.info("successfully saved checkpoint at iteration %7d to %s", job.iteration,
                job.save_dir)
    return job.folder


def _raise_failure(job: SaveJob, error: Optional[BaseException], rank: int) -> NoReturn:
    raise_save_failure(job.iteration, job.save_dir, error, rank)


def raise_save_failure(iteration: int, save_dir: str, error: Optional[BaseException],
                       rank: int) -> NoReturn:
    """Every rank, after a failed vote on a save: its own error, or the lowest failing rank's,
    so that rank 0 (which speaks for all) names the real cause. Collective."""
    failed_rank, message = first_failure(error)
    where = f"saving the checkpoint of iteration {iteration} to {save_dir} failed"
    after = "; the tracker file still names the previous checkpoint"
    if error is not None:
        raise CheckpointError(f"{where} on rank {rank}: {error}{after}") from error
    raise CheckpointError(f"{where} on rank {failed_rank}: {message}{after}")


def run_job(job: SaveJob) -> str:
    """Write and publish ``job`` now (every rank, main thread); returns its folder."""
    error, digests = None, {}
    try:
        digests = job.write()
    except Exception as e:  # noqa: BLE001 - every rank must reach the vote
        error = e
    return finish_save(job, error, digests)


class HostBuffers:
    """Host memory for the copies a background save takes, kept from one save to the next.

    Each save copies the same tensors in the same order, so the second and later saves copy
    into memory that is already mapped (on a CPU several times faster than into fresh pages;
    pinned for a GPU's tensors). The price: between saves the copies stay allocated. A save
    starts only after the previous one is written, so a buffer is never in use twice.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._reserving: Optional[threading.Thread] = None
        self.fresh = 0  # buffers the current save had to allocate (none after ``reserve``)

    def restart(self) -> None:
        """Before a save: copies go into the buffers from the start again (once a
        reservation still under way has finished)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        self._next = self.fresh = 0

    def reserve(self, specs: list[tuple[torch.Size, torch.dtype, bool]]) -> None:
        """Allocate and touch, in a background thread, the buffers a save of tensors of
        ``specs`` (shape, dtype, pinned; in copy order) will copy into, so that the first
        save finds mapped memory as later ones do. Training goes on meanwhile."""
        def allocate() -> None:
            for shape, dtype, pinned in specs:
                buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
                buffer.zero_()  # the pages are mapped here, not in the save
                self._buffers.append(buffer)

        self.restart()
        self._buffers = []
        self._reserving = threading.Thread(target=allocate, name="checkpoint-buffers",
                                           daemon=True)
        self._reserving.start()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (detached, contiguous)."""
        i, self._next = self._next, self._next + 1
        buffer = self._buffers[i] if i < len(self._buffers) else None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                 pin_memory=tensor.is_cuda)
            self.fresh += 1
            if i < len(self._buffers):
                self._buffers[i] = buffer
            else:
                self._buffers.append(buffer)
        buffer.copy_(tensor.detach())
        return buffer


class AsyncSaver:
    """At most one save written in the background at a time (``--async-save``).

    Build it on every rank at the same point (it creates its gloo group, a collective).
    """

    def __init__(self, timeout_minutes: Optional[float] = None) -> None:
        timeout = (datetime.timedelta(minutes=timeout_minutes)
                   if timeout_minutes is not None else None)
        # Collectives from a second thread need a group of their own.
        self.group = dist.new_group(backend="gloo", timeout=timeout) \
            if dist.is_initialized() else None
        self.buffers = HostBuffers()
        self._job: Optional[SaveJob] = None
        self._thread: Optional[threading.Thread] = None
        self._result: tuple[Optional[BaseException], dict[str, FileDigest]] = (None, {})

    @property
    def pending(self) -> Optional[int]:
        """The iteration of the save being written; None when there is none."""
        return None if self._job is None else self._job.iteration

    def start(self, job: SaveJob) -> None:
        """Write ``job`` in the background (after publishing any previous one)."""
        self.wait()
        self._job, self._result = job, (None, {})
        self._thread = threading.Thread(target=self._write, name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            self._result = (None, self._job.write())
        except BaseException as error:  # noqa: BLE001 - reported by finish_save
            self._result = (error, {})

    def poll(self) -> Optional[str]:
        """Publish the pending save if every rank has written it; returns its folder then,
        else None. Collective (one all-reduce) while a save is pending; raises
        ``CheckpointError`` on every rank if a write failed."""
        if self._job is None:
            return None
        if not all_true(not self._thread.is_alive()):
            return None
        return self._finish()

    def wait(self) -> Optional[str]:
        """Wait for the pending save's writes and publish it; returns its folder (None
        without a pending save). Collective; raises ``CheckpointError`` if a write failed."""
        if self._job is None:
            return None
        self._thread.join()
        return self._finish()

    def _finish(self) -> str:
        job, (error, digests) = self._job, self._result
        self._job, self._thread, self._result = None, None, (None, {})
        return finish_save(job, error, digests)

"""Saving a checkpoint in the format ``--ckpt-format`` names (``format.format_named``): the
format takes this rank's state and returns a save job, which this module runs now, or hands
to an ``AsyncSaver`` (``--async-save``) to write in the background from host copies. Every
format's job writes into one temporary folder; global rank 0 adds the manifest and renames the
folder into place, and only then moves the tracker file (``publish.PublishedSave``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from megatron.checkpointing.async_save import AsyncSaver, run_job
from megatron.checkpointing.contents import (
    ModelChunks,
    as_chunks,
    check_extra,
)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.format import SaveRequest, format_named
from megatron.checkpointing.ranks import current_layout
from megatron.checkpointing.rng import gather_rng_states

logger = logging.getLogger(__name__)


def save_checkpoint(iteration: int, model_chunks: ModelChunks, optimizer: Any,
                    opt_param_scheduler: Any, config: Any, *, consumed_train_samples: int,
                    consumed_valid_samples: int = 0, extra: Optional[dict] = None,
                    valid_loss: Optional[float] = None,
                    saver: Optional[AsyncSaver] = None, refuse_nonfinite: bool = False) -> str:
    """Save a checkpoint of ``iteration`` to ``config.checkpoint.save``; returns its folder.

    Every rank must call it (it gathers RNG states, and the distributed optimizer's state,
    over data parallel). ``extra`` entries become top-level keys of every
    ``model_optim_rng.pt`` (plain values or tensors). With ``--save-best`` and a
    ``valid_loss``, the checkpoint is recorded as the best one if its loss is the lowest.
    Raises ``CheckpointError`` if any rank fails; the previous checkpoint stays the latest.
    With ``saver`` the files are written in the background: this returns once the state is
    copied to host memory, and ``saver.poll()`` / ``saver.wait()`` publish the folder (or
    raise the failure) later. ``refuse_nonfinite``: the write fails, naming the tensor, if
    what it would write holds NaN/Inf (checked on the copy, off the training loop's time).
    """
    ckpt = config.checkpoint
    if ckpt.save is None:
        raise CheckpointError("save_checkpoint needs --save")
    check_extra(extra)
    chunks = as_chunks(model_chunks)
    layout = current_layout()
    background = saver is not None
    if background:
        saver.wait()  # one save at a time: the previous one is published first
    logger.info("saving checkpoint at iteration %7d to %s%s", iteration, ckpt.save,
                " (written in the background)" if background else "")
    started = time.perf_counter()
    if background:
        saver.buffers.restart()
    rng_states = None if ckpt.no_save_rng else gather_rng_states(layout)
    fmt = format_named(ckpt.ckpt_format)
    job = fmt.start_save(SaveRequest(
        iteration, chunks, optimizer, opt_param_scheduler, config, layout, rng_states,
        (consumed_train_samples, consumed_valid_samples), extra, valid_loss, saver,
        refuse_nonfinite))
    if saver is None:
        return run_job(job)
    saver.start(job)
    logger.info("checkpoint of iteration %7d copied to host memory in %.2f s; training goes on "
                "while it is written", iteration, time.perf_counter() - started)
    return job.folder


def reserve_host_buffers(iteration: int, model_chunks: ModelChunks, optimizer: Any,
                         opt_param_scheduler: Any, config: Any, saver: AsyncSaver) -> None:
    """--async-save: allocate the host memory of this run's saves now, in the background
    (``HostBuffers.reserve``), so that the first save stops the loop no longer than later
    ones. Every rank calls it at the same point (it takes the state as a save does, a
    collective), after the optimizer's state exists; nothing is copied or written."""
    specs: list[tuple[torch.Size, torch.dtype, bool]] = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        specs.append((tensor.shape, tensor.dtype, tensor.is_cuda))
        return tensor

    chunks = as_chunks(model_chunks)
    layout = current_layout()
    saver.buffers.restart()  # the previous reservation's thread, if any, has finished
    rng_states = None if config.checkpoint.no_save_rng else gather_rng_states(layout)
    format_named(config.checkpoint.ckpt_format).plan_save(
        SaveRequest(iteration, chunks, optimizer, opt_param_scheduler, config, layout,
                    rng_states, (0, 0), None, None), record)
    saver.buffers.reserve(specs)



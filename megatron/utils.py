"""Helpers shared by the entry scripts and the loop: masks and position ids for
left-to-right LMs, and the rank-aware output every message goes through."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

# The ``megatron`` logger: its records and print_rank_0's messages leave through one
# RankOutput handler, so both follow --log-all-ranks.
_LOGGER_NAME = "megatron"


def global_rank() -> int:
    """This process's global rank: torch.distributed's, or before it is up the launcher's
    (RANK from torchrun/deepspeed, SLURM_PROCID from srun), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")) or 0)


def refuse(message: str, status: int = 2) -> NoReturn:
    """End the process before its work starts: ``error: message`` printed by global rank 0
    only (every rank checks the same flags and files and comes here alike), then
    ``SystemExit(status)``."""
    if global_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status) from None


class RankOutput(logging.Handler):
    """Writes each message once, from global rank 0; with ``all_ranks``, from every rank with
    each line prefixed ``[rank N] ``. Errors are written by whichever rank meets them (other
    ranks' prefixed). Warnings and errors go to stderr, the rest to stdout (looked up at each
    write, so redirected streams receive it)."""

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__(logging.INFO)
        self.all_ranks = all_ranks

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record), to_stderr=record.levelno >= logging.WARNING,
                       every_rank=record.levelno >= logging.ERROR)
        except Exception:  # noqa: BLE001 - logging must not raise into the caller
            self.handleError(record)

    def write(self, message: str, to_stderr: bool = False, every_rank: bool = False) -> None:
        rank = global_rank()
        if self.all_ranks or (every_rank and rank != 0):
            message = "\n".join(f"[rank {rank}] {line}" for line in message.split("\n"))
        elif rank != 0:
            return
        stream = sys.stderr if to_stderr else sys.stdout
        stream.write(message + "\n")  # one write: the line and its newline stay together
        stream.flush()


def _installed_output() -> Optional[RankOutput]:
    handlers = logging.getLogger(_LOGGER_NAME).handlers
    return next((h for h in handlers if isinstance(h, RankOutput)), None)


def configure_output(log_all_ranks: bool = False) -> RankOutput:
    """Send print_rank_0 and the ``megatron`` loggers' records (INFO and up) through one
    RankOutput (replacing an earlier one); ``pretrain`` calls it once per run."""
    logger = logging.getLogger(_LOGGER_NAME)
    previous = _installed_output()
    if previous is not None:
        logger.removeHandler(previous)
    handler = RankOutput(log_all_ranks)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def print_rank_0(message: str) -> None:
    """Print (flushed) once, on global rank 0; on every rank, prefixed, under
    --log-all-ranks (see configure_output)."""
    (_installed_output() or RankOutput()).write(message)


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: Optional[int],
                                    reset_position_ids: bool, reset_attention_mask: bool,
                                    eod_mask_loss: bool):
    """Masks for a batch of token ids ``[b, s]`` (Megatron's semantics).

    Returns ``(attention_mask, loss_mask, position_ids)``: ``attention_mask`` is None for the
    plain causal mask, or bool ``[b, 1, s, s]`` with True = masked when documents must not
    attend across their EOD boundaries (``reset_attention_mask``); ``loss_mask`` ``[b, s]``
    float, zero at EOD tokens with ``eod_mask_loss``; ``position_ids`` ``[b, s]``, restarting
    after each EOD with ``reset_position_ids``.
    """
    b, s = tokens.shape
    device = tokens.device
    loss_mask = torch.ones(b, s, dtype=torch.float, device=device)
    positions = torch.arange(s, dtype=torch.long, device=device)
    # Element-wise only: nothing here waits for the device (no boolean indexing, no .tolist()).
    is_eod = tokens == eod_token if eod_token is not None else None
    if eod_mask_loss and is_eod is not None:
        loss_mask.masked_fill_(is_eod, 0.0)
    doc_start = torch.zeros(b, s, dtype=torch.long, device=device)
    if (reset_position_ids or reset_attention_mask) and is_eod is not None:
        # A document starts one past each EOD: position p's document starts one past the
        # last EOD before p (a running maximum, shifted by one position).
        after_eod = torch.where(is_eod, positions + 1, 0)
        doc_start[:, 1:] = after_eod.cummax(dim=1).values[:, :-1]
    position_ids = positions.expand(b, s) - (doc_start if reset_position_ids else 0)
    attention_mask = None
    if reset_attention_mask:
        keys = positions.view(1, 1, 1, s)
        queries = positions.view(1, 1, s, 1)
        visible = (keys <= queries) & (keys >= doc_start.view(b, 1, s, 1))  # [b, 1, s, s]
        attention_mask = ~visible  # True = masked out
    return attention_mask, loss_mask, position_ids

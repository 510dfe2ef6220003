"""The rank-aware output every message goes through: global rank 0 speaks for all (or every rank,
prefixed, with --log-all-ranks), and start-up refusals end every rank alike."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Optional

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

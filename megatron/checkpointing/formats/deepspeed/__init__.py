"""DeepSpeed's checkpoints: the engine's ``global_stepN/`` folders (``files``: what they hold;
``engine_folders``: read whole, ``zero_optim``: ZeRO's optimizer partitions) and DeepSpeed's
universal checkpoints (``universal_folder``: finding and reading the folders ds_to_universal.py
writes; ``universal``: loading one at any layout, into our engine or DeepSpeed's).

Our ``--deepspeed`` runs write and resume engine folders through DeepSpeed's own
``save_checkpoint``/``load_checkpoint`` (``integrations/deepspeed``); this format is what the
rest of the project reads of them: conversion, generation and evaluation, at any layout.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.folder import DEEPSPEED, CheckpointFolder
from megatron.checkpointing.format import LoadRequest, SaveRequest, register_format
from megatron.checkpointing.formats.deepspeed import files
from megatron.checkpointing.formats.deepspeed.engine_folders import read_deepspeed_folder
from megatron.checkpointing.full_state import FullCheckpoint

_ENGINE_ONLY = ("DeepSpeed's checkpoints are written and resumed by DeepSpeed's engine: train "
                "with --deepspeed (with the --zero-stage and --deepspeed_config it was saved "
                "with), or convert it with tools/checkpoint/convert.py")


class DeepSpeedFormat:
    """``format.Format`` of DeepSpeed engine folders."""

    name = "deepspeed"
    naming = DEEPSPEED
    fallback = True

    def recognise(self, iter_dir: str) -> bool:
        return bool(files.deepspeed_files(iter_dir))

    def layout(self, iter_dir: str) -> tuple[int, int]:
        return files.deepspeed_layout(iter_dir)

    def stored_config(self, iter_dir: str) -> Optional[dict]:
        return files.deepspeed_config(iter_dir)

    def common(self, iter_dir: str) -> dict:
        return files.deepspeed_common(iter_dir)

    def start_save(self, request: SaveRequest) -> Any:
        raise CheckpointError(_ENGINE_ONLY)

    def plan_save(self, request: SaveRequest, record: Any) -> None:
        raise CheckpointError(_ENGINE_ONLY)

    def load(self, folder: CheckpointFolder, request: LoadRequest) -> Any:
        raise CheckpointError(f"{folder.path}: {_ENGINE_ONLY}")

    def read_whole(self, folder: CheckpointFolder, *, verify: bool,
                   true_vocab_size: Optional[int], optimizer: bool) -> FullCheckpoint:
        return read_deepspeed_folder(folder, true_vocab_size, verify=verify,
                                     optimizer=optimizer)

    def loads_at(self, folder: CheckpointFolder, parallel: Any) -> bool:
        return False  # read whole and cut for each rank


DEEPSPEED_FORMAT = DeepSpeedFormat()
register_format(DEEPSPEED_FORMAT)

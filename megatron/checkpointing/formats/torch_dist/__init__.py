"""Megatron-LM's distributed format (``--ckpt-format torch_dist``): megatron-core's tensor
names and layouts (``mcore_layout``; the distributed optimizer's flat buckets:
``mcore_buckets``), written and read as boxes of global tensors through
torch.distributed.checkpoint (``dcp``). ``checkpoint``: the folder (common.pt, metadata.json)
and a rank's save and read; ``optim``: the optimizer's state in it; ``load``: --load at any
layout; ``whole``: the whole checkpoint in one process."""

from __future__ import annotations

from typing import Any, Optional

from megatron.checkpointing.folder import MEGATRON, CheckpointFolder
from megatron.checkpointing.format import LoadRequest, SaveRequest, register_format
from megatron.checkpointing.formats.torch_dist import checkpoint, load, whole
from megatron.checkpointing.full_state import FullCheckpoint


class TorchDistFormat:
    """``format.Format`` of torch_dist folders (ours and Megatron-LM's)."""

    name = checkpoint.FORMAT
    naming = MEGATRON
    fallback = False

    def recognise(self, iter_dir: str) -> bool:
        return checkpoint.recognise(iter_dir)

    def layout(self, iter_dir: str) -> tuple[int, int]:
        return checkpoint.folder_layout(iter_dir)

    def stored_config(self, iter_dir: str) -> Optional[dict]:
        return checkpoint.folder_config(iter_dir)

    def common(self, iter_dir: str) -> dict:
        return checkpoint.read_common(iter_dir)

    def start_save(self, request: SaveRequest) -> checkpoint.TorchDistSaveJob:
        return checkpoint.start_save(request)

    def plan_save(self, request: SaveRequest, record: Any) -> None:
        r = request
        checkpoint.prepare_save(r.iteration, r.chunks, r.optimizer, r.scheduler, r.config,
                                r.layout, r.rng_states, r.consumed, r.extra,
                                copy_to_host=record)

    def load(self, folder: CheckpointFolder, request: LoadRequest) -> Any:
        return load.load(folder, request)

    def read_whole(self, folder: CheckpointFolder, *, verify: bool,
                   true_vocab_size: Optional[int], optimizer: bool) -> FullCheckpoint:
        return whole.load_torch_dist_checkpoint(folder, verify=verify,
                                                true_vocab_size=true_vocab_size,
                                                optimizer=optimizer)

    def loads_at(self, folder: CheckpointFolder, parallel: Any) -> bool:
        return True  # each rank reads its own pieces at any layout


TORCH_DIST = TorchDistFormat()
register_format(TORCH_DIST)

"""What a DeepSpeed engine's checkpoint folder (``global_stepN/``) holds, told by its file
names, what can be read from it without the weights (its layout, its client state), and the
readers of its files that need DeepSpeed's own code (its pickled classes, ZeRO-3's gathering):
those import deepspeed when called, so that the other formats and the tools that never read
a DeepSpeed checkpoint run without it installed."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Optional

import torch

from megatron.checkpointing.contents import stored_config
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import read_torch

_DS_MP_FILE_RE = re.compile(r"mp_rank_(\d{2})_model_states\.pt")


_DS_ZERO3_FILE_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt")


def deepspeed_files(iter_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(iter_dir) if n.endswith("model_states.pt"))


def _deepspeed_state_files(iter_dir: str) -> tuple[list[str], list[str]]:
    names = deepspeed_files(iter_dir)
    return ([n for n in names if _DS_MP_FILE_RE.fullmatch(n)],
            [n for n in names if _DS_ZERO3_FILE_RE.fullmatch(n)])


def deepspeed_model_state_files(iter_dir: str) -> tuple[list[str], list[str]]:
    """The names of a DeepSpeed folder's ``mp_rank_XX_model_states.pt`` files (the engine's
    and the client state, one per model-parallel rank) and of ZeRO-3's
    ``zero_pp_rank_N_mp_rank_XX_model_states.pt`` (in their place), each sorted; a
    ``CheckpointError`` without either."""
    mp_files, zero3_files = _deepspeed_state_files(iter_dir)
    if not mp_files and not zero3_files:
        raise CheckpointError(f"{iter_dir} has no mp_rank_XX_model_states.pt (nor ZeRO-3's "
                              "zero_pp_rank_N_mp_rank_XX_model_states.pt): not a DeepSpeed "
                              "checkpoint")
    return mp_files, zero3_files


def deepspeed_common(iter_dir: str) -> dict:
    """The first model-parallel rank's model-states file (memory-mapped), which holds the
    engine's client state."""
    mp_files, zero3_files = deepspeed_model_state_files(iter_dir)
    return read_torch(os.path.join(iter_dir, (mp_files or zero3_files)[0]), mmap=True)


def deepspeed_config(iter_dir: str) -> Optional[dict]:
    if not any(_deepspeed_state_files(iter_dir)):
        return None
    return stored_config(deepspeed_common(iter_dir))


def deepspeed_layout(iter_dir: str) -> tuple[int, int]:
    """From the run configuration its client state stores (ours: the parallel slice;
    Megatron-DeepSpeed's: its flags), else from its files' model-parallel ranks (a
    pipeline's stages are not told apart by name)."""
    try:
        stored = deepspeed_config(iter_dir)
    except CheckpointError:
        stored = None
    sizes = stored.get("parallel", stored) if isinstance(stored, dict) else {}
    if not isinstance(sizes, dict):
        sizes = {}
    if sizes.get("tensor_model_parallel_size") or sizes.get("pipeline_model_parallel_size"):
        return (int(sizes.get("tensor_model_parallel_size") or 1),
                int(sizes.get("pipeline_model_parallel_size") or 1))
    mp_files, zero3_files = _deepspeed_state_files(iter_dir)
    ranks = ({_DS_MP_FILE_RE.fullmatch(n).group(1) for n in mp_files}
             | {_DS_ZERO3_FILE_RE.fullmatch(n).group(2) for n in zero3_files})
    return max(len(ranks), 1), 1


def zero3_full_weights(load_dir: str, tag: str) -> dict:
    """The full fp32 model of a ZeRO-3 checkpoint ``load_dir/tag``, gathered from the
    data-parallel partitions by DeepSpeed's own ``zero_to_fp32`` (its model-state files hold
    only empty placeholders). Model-parallel rank 0's files only: the caller refuses tp > 1.
    What DeepSpeed prints meanwhile goes to stderr: stdout is the tools' output (generated
    text)."""
    with contextlib.redirect_stdout(sys.stderr):
        # optional: deepspeed (only to read DeepSpeed's checkpoints)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(load_dir, tag=tag))


def read_zero_optimizer_file(path: str) -> dict:
    """A ``zero_pp_rank_*_optim_states.pt`` file, unpickled with only the DeepSpeed classes it
    holds (loss scaler, ZeRO stage, fragment addresses) allowed beside tensors."""
    with torch.serialization.safe_globals(pickled_classes()):
        return torch.load(path, map_location="cpu", weights_only=True)


def pickled_classes() -> list:
    """The DeepSpeed classes its optimizer files pickle (loss scaler, ZeRO stage, fragment
    addresses): none runs code when unpickled."""
    # optional: deepspeed (only to read DeepSpeed's checkpoints)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

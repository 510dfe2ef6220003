"""A whole checkpoint in one process: read every shard of a folder into one tp 1 / pp 1 state
(``load_full_checkpoint``), and write such a state at any tensor/pipeline layout
(``save_full_checkpoint``) in the layout ``megatron/checkpointing/`` saves and loads."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

from megatron.checkpointing.contents import (
    layout_dict,
)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import write_torch
from megatron.checkpointing.folder import (
    DEEPSPEED,
    MEGATRON,
    CheckpointFolder,
    checkpoint_at,
    find_checkpoint,
    latest_checkpoint,
    make_tmp_folder,
    namings_in,
    no_checkpoint_error,
    publish_checkpoint,
)
from megatron.checkpointing.formats.torch.cut import LayoutCut, mixed_precision
from megatron.checkpointing.full_state import (
    FullCheckpoint,
)
from megatron.checkpointing.load import check_load_dir
from megatron.checkpointing.manifest import build_manifest
from megatron.checkpointing.paths import (
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    mp_rank_dir_name,
)
from megatron.checkpointing.run_config import with_layout
from megatron.config import ConfigError, ParallelConfig
from megatron.model.placement import Chunk, pipeline_chunks

logger = logging.getLogger(__name__)

# CONVERTED_KEY: the top-level entry of a converted model_optim_rng.pt saying where it came
# from. Its files hold no random-generator state (one rank's generators mean nothing on another
# layout), and loading such a checkpoint starts the generators from --seed instead of asking
# for --no-load-rng.


# Reading -----------------------------------------------------------------------------------


def load_full_checkpoint(load_dir: str, iteration: Optional[int] = None, *,
                         verify: bool = True, true_vocab_size: Optional[int] = None,
                         optimizer: bool = True) -> FullCheckpoint:
    """Read the checkpoint of ``load_dir`` (the tracker's, or ``iteration``'s) at whatever
    tensor/pipeline/virtual-pipeline layout it was saved with, into one ``FullCheckpoint``.

    Reads our checkpoints (checked against their manifest unless ``verify`` is False),
    Megatron-DeepSpeed / Megatron-LM ones (their ``language_model`` layout, model only;
    ``true_vocab_size`` when their flags do not record the unpadded vocabulary), and
    torch_dist folders, Megatron-LM's or ours (``checkpointing/formats/torch_dist/whole.py``).
    ``optimizer=False`` reads (and checks) the model files only: ``optimizer`` stays None.
    """
    return read_folder(_iteration_folder(load_dir, iteration), verify=verify,
                       true_vocab_size=true_vocab_size, optimizer=optimizer)


def read_checkpoint(load_dir: str, *, verify: bool = True, optimizer: bool = True,
                    true_vocab_size: Optional[int] = None, flag: str = "--load") -> FullCheckpoint:
    """The whole model of ``load_dir``'s latest checkpoint of any kind
    (``checkpointing.folder.find_checkpoint``: ours, Megatron-LM's and Megatron-DeepSpeed's,
    torch_dist, DeepSpeed's engines), as ``read_folder`` reads it; a folder without one is a
    ``CheckpointError`` naming ``flag``."""
    folder = find_checkpoint(load_dir)
    if folder is None:
        raise no_checkpoint_error(load_dir, flag)
    return read_folder(folder, verify=verify, true_vocab_size=true_vocab_size,
                       optimizer=optimizer)


def read_folder(folder: CheckpointFolder, *, verify: bool = True,
                true_vocab_size: Optional[int] = None, optimizer: bool = True) -> FullCheckpoint:
    """One checkpoint folder of any format (``folder.format``) as one ``FullCheckpoint``, by
    that format's reader (``Format.read_whole``); ``verify``, ``optimizer`` and
    ``true_vocab_size`` as for ``load_full_checkpoint``."""
    return folder.format.read_whole(folder, verify=verify, true_vocab_size=true_vocab_size,
                                    optimizer=optimizer)
def _iteration_folder(load_dir: str, iteration: Optional[int]) -> CheckpointFolder:
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load-dir {load_dir} is not a folder")
    if namings_in(load_dir) == [DEEPSPEED]:
        raise CheckpointError(f"--load-dir {load_dir} holds no {TRACKER_FILENAME}: it looks like "
                              "a DeepSpeed checkpoint: use --loader deepspeed")
    check_load_dir(load_dir)
    if iteration is not None:
        return checkpoint_at(load_dir, iteration)
    folder = latest_checkpoint(load_dir)
    if folder is None:
        hint = "pass the folder a training run saved into (its --save)"
        if os.path.isfile(os.path.join(load_dir, "config.json")):
            hint = "it looks like a Hugging Face model: use --loader hf"
        raise CheckpointError(f"--load-dir {load_dir} holds no {TRACKER_FILENAME}: {hint}")
    return folder


# Writing -----------------------------------------------------------------------------------


def save_full_checkpoint(full: FullCheckpoint, save_dir: str, tp: int = 1, pp: int = 1, *,
                         num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                         use_distributed_optimizer: Optional[bool] = None,
                         source: str = "") -> str:
    """Write ``full`` into ``save_dir`` at tensor-parallel size ``tp`` and pipeline size
    ``pp`` (interleaved with ``num_layers_per_virtual_pipeline_stage``), as our training saves
    it: ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` (``release/`` for a release
    checkpoint), ``distrib_optim.pt`` with the distributed optimizer (default: as the source),
    ``manifest.json`` and the tracker file, written to a temporary folder and renamed into
    place. Returns the iteration folder. The vocabulary is re-padded for ``tp`` (rows past
    the true vocabulary are padding: zero where new). No random-generator state is written.
    """
    distributed = full.distributed_optimizer if use_distributed_optimizer is None \
        else use_distributed_optimizer
    chunks = _target_chunks(full, tp, pp, num_layers_per_virtual_pipeline_stage)
    config = with_layout(full.config, tp, pp, num_layers_per_virtual_pipeline_stage,
                         distributed if full.optimizer is not None else None)
    cut = LayoutCut(full, tp, config, distributed=distributed, mixed=mixed_precision(config),
                    source=source or "a full checkpoint")
    files = {}
    for t in range(tp):
        for p in range(pp):
            folder = mp_rank_dir_name(t, p, pp)
            state, distrib = cut.rank_files(chunks[p], t, pp)
            files[f"{folder}/{MODEL_FILENAME}"] = state
            if distrib is not None:
                files[f"{folder}/{DISTRIB_OPTIM_FILENAME}"] = distrib
    return _write_folder(save_dir, full, config, files, len(chunks[0]))


def _target_chunks(full: FullCheckpoint, tp: int, pp: int,
                   layers_per_virtual_stage: Optional[int]) -> list[list[Chunk]]:
    """The chunks of each target pipeline stage, after checking the layout fits the model
    as training would (heads and MLP over tp, layers over pp and virtual stages)."""
    num_layers = full.config["model"]["num_layers"]
    try:
        full.model_config(tp)
        parallel = ParallelConfig(world_size=tp * pp, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp,
                                  num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage)
        vp = parallel.check_virtual_pipeline(num_layers)
        if layers_per_virtual_stage is not None and vp is None:
            raise ConfigError(f"{layers_per_virtual_stage} layers per virtual stage is the "
                              f"whole stage ({num_layers} layers over {pp} stages): drop it")
        return pipeline_chunks(num_layers, pp, vp)
    except ConfigError as error:
        raise ValueError(f"cannot save at tensor-parallel size {tp}, pipeline size {pp}: "
                         f"{error}") from None


def _write_folder(save_dir: str, full: FullCheckpoint, config: dict, files: dict,
                  num_chunks: int) -> str:
    """Write ``files`` (relative path -> dict) into a temporary folder, then publish it with
    its manifest and point the tracker at it (``megatron.checkpointing.folder``)."""
    name = MEGATRON.folder_name(full.iteration, full.release)
    tmp = make_tmp_folder(save_dir, name)
    try:
        digests = {}
        for rel, obj in files.items():
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            digests[rel] = write_torch(obj, os.path.join(tmp, rel))
        layout = config["parallel"]
        manifest = build_manifest(
            full.iteration, layout_dict(layout["tensor_model_parallel_size"],
                                        layout["pipeline_model_parallel_size"], 1, num_chunks),
            config, digests)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_checkpoint(save_dir, tmp, full.iteration, manifest, release=full.release)

"""Save and load training checkpoints in Megatron's layout, atomically and verified.

On disk (as Megatron-LM / Megatron-DeepSpeed)::

    SAVE/latest_checkpointed_iteration.txt     "100" (or "release": the folder release/)
    SAVE/iter_0000100/mp_rank_{tp:02d}/model_optim_rng.pt              pipeline size 1
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt     pipeline size > 1
    SAVE/iter_0000100/mp_rank_.../distrib_optim.pt   with --use-distributed-optimizer
    SAVE/iter_0000100/manifest.json            ours: every file's size and CRC-32, the config
    SAVE/best_checkpointed_iteration.txt       with --save-best: iteration and its valid loss

``model_optim_rng.pt`` is written by data-parallel rank 0 of each (tensor, pipeline) rank and
holds ``checkpoint_version`` (3.0), ``iteration``, ``config`` (the resolved RunConfig as plain
dicts), ``parallel_layout``, ``consumed_train_samples``/``consumed_valid_samples``, ``model``
(``model0``, ``model1``, ... for virtual-pipeline chunks), ``optimizer``,
``opt_param_scheduler``, ``rng_state`` (one entry per data-parallel rank: python, numpy, torch
CPU/CUDA generators and the tensor-parallel tracker) and whatever the caller passed as
``extra`` (e.g. ``num_floating_point_operations_so_far``) as further top-level keys.
The distributed optimizer's state is in ``distrib_optim.pt`` (full, unsharded tensors keyed by
parameter name), so it loads at any data-parallel size; data-parallel rank 0 receives it one
parameter at a time and streams it into the file, so no rank holds more than its own shard
and one parameter's buffer.
``manifest.json`` (see ``manifest.py``) records what an intact folder is; loading checks each
file it reads against it, and compares the model flags with the config stored there. Folders
without one (older saves, Megatron-LM's) load with a warning that they were not verified.

A save writes everything into ``SAVE/iter_XXXXXXX.tmp-<unique>``; when every rank has
succeeded, global rank 0 writes the manifest, renames that folder to ``iter_XXXXXXX`` and only
then replaces the tracker file. A crash at any point leaves the previous checkpoint the one the
tracker names; the next save removes the temporary folder such a crash left behind. Loading
takes the tracker's folder, or the newest complete one when the tracker is missing, empty or
names a folder that is gone or incomplete (``folder.latest_checkpoint``). With
``--async-save`` the files are written by a background thread from a host copy and published
later (``async_save.AsyncSaver``). A run holds an advisory lock on its ``--save`` folder
(``lock.py``).
Files are read with ``torch.load(weights_only=True)``: everything stored is tensors and plain
Python values.

``--ckpt-format torch_dist`` writes Megatron-LM's distributed format instead (``torch_dist``:
``metadata.json``, ``common.pt``, ``.metadata``, ``__R_N.distcp`` through
``torch.distributed.checkpoint``, megatron-core's tensor names), each rank its own shards;
``--load`` reads it, and Megatron-LM's own, at any tensor/pipeline/data-parallel size. The
manifest, the temporary folder and the publishing are the same.

Formats are objects (``format.Format``: recognise a folder, its layout and stored config,
start a save, load a rank's part, read the whole, say whether it loads at a layout), one
subpackage each under ``formats/`` (``torch``, ``torch_dist``, ``deepspeed``), registered by
name; save, load, generation, evaluation and conversion reach them only through the registry
(``format_named``) and ``folder.format``. What every format shares stays here: ``folder``
(the folder layout: tracker files, iteration folders, the latest complete checkpoint,
publishing), ``format`` (the protocol and the registry), ``paths`` (file names, --save
checks), ``files`` (atomic writes, checksums, safe reads), ``ranks`` (this rank's place,
collectives), ``contents`` (what a rank file holds), ``rng``, ``manifest`` (verification),
``model_shape``, ``run_config``, ``full_state`` (``FullCheckpoint``: a whole checkpoint at tp 1
/ pp 1), ``optim_state`` (optimizer state by parameter name), ``publish`` (a save job's
folder and publishing), ``async_save``, ``save`` and ``load`` (the drivers), ``retention``
(leftovers, pruning, best), ``lock``.
"""

from megatron.checkpointing import formats  # noqa: F401 - registers the formats
from megatron.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLayoutError,
)
from megatron.checkpointing.folder import (
    CheckpointFolder,
    Tracker,
    checkpoint_at,
    checkpoint_path,
    iteration_dir_name,
    latest_checkpoint,
    list_iterations,
    read_tracker,
)
from megatron.checkpointing.format import Format, format_named, register_format
from megatron.checkpointing.load import (
    LoadedCheckpoint,
    LoadReport,
    check_load_dir,
    checkpoint_model_settings,
    load_checkpoint,
    load_checkpoint_config,
    load_scheduler_state,
)
from megatron.checkpointing.manifest import read_manifest
from megatron.checkpointing.paths import (
    BEST_FILENAME,
    CHECKPOINT_VERSION,
    DISTRIB_OPTIM_FILENAME,
    MANIFEST_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    BestCheckpoint,
    check_save_dir,
    mp_rank_dir_name,
    read_best,
)
from megatron.checkpointing.retention import (
    prune_checkpoints,
    remove_leftover_folders,
    update_best_checkpoint,
)
from megatron.checkpointing.save import reserve_host_buffers, save_checkpoint

__all__ = [
    "BEST_FILENAME",
    "CHECKPOINT_VERSION",
    "DISTRIB_OPTIM_FILENAME",
    "MANIFEST_FILENAME",
    "MODEL_FILENAME",
    "TRACKER_FILENAME",
    "BestCheckpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFolder",
    "CheckpointLayoutError",
    "Format",
    "LoadReport",
    "LoadedCheckpoint",
    "Tracker",
    "check_load_dir",
    "check_save_dir",
    "checkpoint_at",
    "checkpoint_model_settings",
    "checkpoint_path",
    "format_named",
    "iteration_dir_name",
    "latest_checkpoint",
    "list_iterations",
    "load_checkpoint",
    "load_checkpoint_config",
    "load_scheduler_state",
    "mp_rank_dir_name",
    "prune_checkpoints",
    "read_best",
    "read_manifest",
    "read_tracker",
    "register_format",
    "remove_leftover_folders",
    "reserve_host_buffers",
    "save_checkpoint",
    "update_best_checkpoint",
]

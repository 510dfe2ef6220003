"""Loading: find the tracker's folder, check it fits this run (layout, model shape) and is
intact (the manifest), then copy weights, optimizer, scheduler and generators in."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from megatron.checkpointing.contents import (
    ModelChunks,
    as_chunks,
)
from megatron.checkpointing.errors import (
    CheckpointError,
)
from megatron.checkpointing.folder import (
    DEEPSPEED,
    MEGATRON,
    CheckpointFolder,
    Naming,
    find_checkpoint,
    latest_checkpoint,
    namings_in,
)
from megatron.checkpointing.format import LoadRequest
from megatron.checkpointing.formats.deepspeed.universal_folder import find_universal
from megatron.checkpointing.loaded import LoadedCheckpoint, LoadReport  # noqa: F401 - re-exported
from megatron.checkpointing.model_shape import saved_model_fields
from megatron.checkpointing.paths import (
    MP_RANK_RE,
    TRACKER_FILENAME,
)
from megatron.checkpointing.ranks import (
    check_same_everywhere,
    current_layout,
    raise_together,
)
from megatron.config import ConfigError

logger = logging.getLogger(__name__)


def load_checkpoint(model_chunks: ModelChunks, optimizer: Any, opt_param_scheduler: Any,
                    config: Any, *, strict: bool = True) -> LoadedCheckpoint:
    """Load the latest checkpoint of ``config.checkpoint.load`` into this rank's model.

    Returns ``(iteration, consumed_train_samples, consumed_valid_samples)`` (and ``.extra``):
    zeros when there is no ``--load`` or no tracker file in it. ``--finetune`` and release
    checkpoints load the weights only and restart at iteration 0; ``--no-load-optim`` skips
    the optimizer and scheduler, ``--no-load-rng`` the generators. The files read are checked
    against the checkpoint's manifest first (``--no-verify-checkpoint``: sizes only), and the
    model flags against the config stored with it. Every rank must call it.
    """
    ckpt = config.checkpoint
    if ckpt.load is None:
        return LoadedCheckpoint()
    check_load_dir(ckpt.load)
    folder = _agreed_latest(ckpt.load)
    if folder is None:
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint in --load "
                                  f"{ckpt.load} (no {TRACKER_FILENAME} there)")
        logger.warning("no checkpoint in %s (no %s there): starting from scratch", ckpt.load,
                       TRACKER_FILENAME)
        return LoadedCheckpoint()

    chunks = as_chunks(model_chunks)
    layout = current_layout()
    model_only = ckpt.finetune or folder.release
    load_optim = not model_only and not ckpt.no_load_optim
    return folder.format.load(folder, LoadRequest(chunks, optimizer, opt_param_scheduler, config,
                                                  layout, model_only, load_optim, strict))


def _agreed_latest(load_dir: str) -> Optional[CheckpointFolder]:
    """``latest_checkpoint(load_dir)``, the same on every rank (an error on any is raised on
    all, so none waits for the others in a collective)."""
    error, folder = None, None
    try:
        folder = latest_checkpoint(load_dir)
    except CheckpointError as e:
        error = e
    raise_together(error)
    check_same_everywhere(-1 if folder is None else folder.iteration, "the latest iteration")
    return folder


def load_scheduler_state(load_dir: str, naming: Naming = MEGATRON,
                         universal: bool = False) -> Optional[tuple[str, dict]]:
    """The learning-rate schedule stored with the latest checkpoint of ``load_dir`` (``naming``
    DEEPSPEED: the one our DeepSpeed engine stores in its client state; ``universal``
    (--universal-checkpoint), or ``load_dir`` a universal checkpoint: the one copied into
    it): its folder and state, or None when there is none to resume (no checkpoint, a
    release one, a format or file that cannot be read ahead: loading reports those). Reads
    one small entry of a memory-mapped file, so it is cheap enough to check before anything
    is built."""
    try:
        found = find_universal(load_dir, universal)
        if found is not None:
            path, state = found.path, found.common
        else:
            folder = latest_checkpoint(load_dir, naming, warn=False)  # the load warns
            if folder is None or folder.release:
                return None
            path, state = folder.path, folder.format.common(folder.path)
    except (CheckpointError, OSError):
        return None
    saved = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    return (path, saved) if isinstance(saved, dict) else None


def load_checkpoint_config(load_dir: str) -> Optional[dict]:
    """The run configuration stored with the latest checkpoint of ``load_dir`` (plain dicts;
    Megatron's checkpoints: their argparse fields), or None if there is no checkpoint or it
    stores none (for ``--use-checkpoint-args``). Read from the manifest when there is one."""
    folder = latest_checkpoint(load_dir)
    return None if folder is None else folder.config()


# What --use-checkpoint-args takes from the checkpoint: the model's shape (as Megatron's
# load_args_from_checkpoint does); the parallel layout and the run stay the user's.
CHECKPOINT_MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
    "layernorm_epsilon", "untie_embeddings_and_output_weights", "position_embedding_type",
    "rotary_percent", "rotary_base", "add_bias_linear", "activation", "normalization",
    "swiglu", "group_query_attention", "num_query_groups", "add_qkv_bias",
    "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
)
# And of a checkpoint with experts (--num-experts above 1), their shape and routing.
CHECKPOINT_MOE_FIELDS = (
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
)


def checkpoint_model_settings(load_dir: str) -> dict[str, Any]:
    """The model-shape values stored in the latest checkpoint of ``load_dir`` (any kind:
    ours, Megatron's, DeepSpeed's), for ``parse_args(checkpoint_settings=...)``; a
    ``ConfigError`` naming --use-checkpoint-args when there is none to read."""
    try:
        folder = find_checkpoint(load_dir)
        stored = None if folder is None else folder.config()
    except (CheckpointError, OSError) as error:
        raise ConfigError(f"--use-checkpoint-args: cannot read --load {load_dir}: "
                          f"{error}") from None
    if folder is None:
        raise ConfigError(f"--use-checkpoint-args: --load {load_dir} holds no checkpoint")
    if not isinstance(stored, dict):
        raise ConfigError(f"--use-checkpoint-args: {folder.path} stores no run configuration "
                          "(no 'config' or 'args')")
    model = saved_model_fields(stored)  # ours: nested slices; Megatron's: flat args
    names = CHECKPOINT_MODEL_FIELDS
    experts = model.get("num_experts")  # Megatron-DeepSpeed keeps a list: not these layers
    if isinstance(experts, int) and experts > 1:
        names += CHECKPOINT_MOE_FIELDS
    settings = {k: model[k] for k in names if model.get(k) is not None}
    if "moe_layer_freq" in settings:  # Megatron-LM keeps an int or a list, the flag a string
        settings["moe_layer_freq"] = str(settings["moe_layer_freq"])
    return settings


def check_load_dir(load_dir: str, deepspeed: bool = False, universal: bool = False) -> None:
    """``--load`` must be the folder that holds the tracker file, or not exist yet (a first
    run with ``--save`` and ``--load`` the same folder starts from scratch), or name a
    DeepSpeed universal checkpoint (``universal``: --universal-checkpoint, see
    ``universal.find_universal``). ``deepspeed``: the run trains with DeepSpeed's engine,
    which reads DeepSpeed's checkpoints."""
    if find_universal(load_dir, universal) is not None or not os.path.exists(load_dir):
        return
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir} is a file, not a checkpoint folder: pass the "
                              f"folder that holds {TRACKER_FILENAME} (the --save of the run "
                              "that wrote it)")
    found = namings_in(load_dir)
    if MEGATRON in found:
        return
    if DEEPSPEED in found:
        if deepspeed:
            return
        raise CheckpointError(f"--load {load_dir} holds a DeepSpeed checkpoint (its "
                              f"'{DEEPSPEED.tracker}' file names the tag), which the built-in "
                              "engine does not read: add --deepspeed (with the --zero-stage "
                              "and --deepspeed_config it was saved with) to resume it")
    name = os.path.basename(os.path.normpath(load_dir))
    has_ranks = any(MP_RANK_RE.fullmatch(n) for n in os.listdir(load_dir))
    if has_ranks or MEGATRON.iteration_of(name) is not None or name == MEGATRON.release:
        raise CheckpointError(f"--load {load_dir} is one iteration's folder, not a checkpoint "
                              f"folder: pass its parent, {os.path.dirname(load_dir) or '.'} "
                              f"(with {TRACKER_FILENAME} naming the iteration to load)")

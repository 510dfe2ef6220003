"""What one ``model_optim_rng.pt`` holds: building its dict at save time, and reading its
entries (version, consumed samples, the caller's extras) at load time."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Optional, Union

from torch import nn

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.paths import CHECKPOINT_VERSION
from megatron.checkpointing.ranks import RankLayout
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.optimizer.optimizer import shards_state

ModelChunks = Union[nn.Module, Sequence[nn.Module]]

MODEL_KEY_RE = re.compile(r"model\d*")
# Set by megatron/conversion in the files it writes (they hold no random-generator state).
CONVERTED_KEY = "converted_from"
# Top-level keys this package reads itself; anything else in a file is the caller's ``extra``.
RESERVED_KEYS = frozenset({
    "checkpoint_version", "iteration", "config", "args", "parallel_layout",
    "consumed_train_samples", "consumed_valid_samples", "optimizer", "distributed_optimizer",
    "opt_param_scheduler", "lr_scheduler", "rng_state", "random_rng_state", "np_rng_state",
    "torch_rng_state", "cuda_rng_state", "rng_tracker_states", "tokens",
    "content_metadata",  # torch_dist's common.pt (megatron-core's sharding settings)
    CONVERTED_KEY,
})


def as_chunks(model_chunks: ModelChunks) -> list[nn.Module]:
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    return list(model_chunks)


def model_keys(num_chunks: int) -> list[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def config_dict(config: Any) -> dict:
    """The resolved run configuration as plain dicts."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dataclasses.asdict(config)


def parallel_layout_dict(layout: RankLayout, num_chunks: int) -> dict:
    return layout_dict(layout.tp_size, layout.pp_size, layout.dp_size, num_chunks)


def layout_dict(tp: int, pp: int, dp: int, num_chunks: int) -> dict:
    """The ``parallel_layout`` entry of a rank file and of the manifest."""
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "data_parallel_size": dp, "num_model_chunks": num_chunks}


def rank_file_state(*, iteration: int, config: dict, parallel_layout: dict,
                    consumed: tuple[int, int], models: Sequence[dict],
                    optimizer: Optional[dict] = None, distributed_optimizer: bool = False,
                    scheduler: Optional[dict] = None, rng_states: Optional[list[dict]] = None,
                    converted_from: Optional[str] = None, extra: Optional[dict] = None) -> dict:
    """The dict one ``model_optim_rng.pt`` holds, from its parts: ``models`` (one state dict
    per model chunk), ``optimizer`` (a torch/Megatron optimizer's state dict) or
    ``distributed_optimizer`` (its state is in ``distrib_optim.pt``), the scheduler's state,
    the RNG states of every data-parallel rank, ``converted_from`` for a converter's files."""
    state: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(iteration),
        "config": config,
        "parallel_layout": parallel_layout,
        "consumed_train_samples": int(consumed[0]),
        "consumed_valid_samples": int(consumed[1]),
    }
    if converted_from is not None:
        state[CONVERTED_KEY] = converted_from
    state.update(zip(model_keys(len(models)), models))
    if distributed_optimizer:
        state["distributed_optimizer"] = True
    elif optimizer is not None:
        state["optimizer"] = optimizer
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler
    if rng_states is not None:
        state["rng_state"] = rng_states
    state.update(extra or {})
    return state


def build_state(iteration: int, chunks: list[nn.Module], optimizer: Any, scheduler: Any,
                config: Any, layout: RankLayout, rng_states: Optional[list[dict]],
                consumed: tuple[int, int], extra: Optional[dict], *,
                whole: Optional[tuple[list[dict], Optional[dict]]] = None) -> dict:
    """The dict this rank's ``model_optim_rng.pt`` holds (its tensors are the live ones).
    ``whole``: the models' and plain optimizer's state with every expert
    (``experts.gathered_for_save``), in place of this rank's own."""
    save_optim = not config.checkpoint.no_save_optim
    distributed = save_optim and shards_state(optimizer)
    models = [unwrap_model(chunk).state_dict() for chunk in chunks]
    optimizer_state = (optimizer.state_dict() if save_optim and not distributed
                       and optimizer is not None and whole is None else None)
    if whole is not None:
        models, optimizer_state = whole
    return rank_file_state(
        iteration=iteration, config=config_dict(config),
        parallel_layout=parallel_layout_dict(layout, len(chunks)), consumed=consumed,
        models=models,
        optimizer=optimizer_state,
        distributed_optimizer=distributed,
        scheduler=scheduler.state_dict() if save_optim and scheduler is not None else None,
        rng_states=rng_states, extra=extra)


def check_extra(extra: Optional[dict]) -> None:
    for key in extra or {}:
        if key in RESERVED_KEYS or MODEL_KEY_RE.fullmatch(key):
            raise ValueError(f"extra checkpoint entry {key!r} would overwrite a checkpoint key")


def extra_entries(state: dict) -> dict:
    return {k: v for k, v in state.items()
            if k not in RESERVED_KEYS and not MODEL_KEY_RE.fullmatch(k)}


def check_version(state: dict, path: str) -> None:
    version = state.get("checkpoint_version", 0)
    if version < 3.0:
        raise CheckpointError(f"{path} has checkpoint_version {version}: checkpoints older than "
                              f"3.0 order the query/key/value weights differently; "
                              "convert it to version 3.0 with Megatron-LM's tools first")
    if "iteration" not in state:
        raise CheckpointError(f"{path} has no 'iteration' entry")


def consumed_samples(state: dict) -> tuple[int, int]:
    if "consumed_train_samples" in state:
        return int(state["consumed_train_samples"]), int(state.get("consumed_valid_samples", 0))
    args = state.get("args")  # Megatron keeps them in its argparse Namespace
    return (int(getattr(args, "consumed_train_samples", 0) or 0),
            int(getattr(args, "consumed_valid_samples", 0) or 0))


def stored_config(state: dict) -> Optional[dict]:
    """The run configuration a file stores: ours under 'config', Megatron's argparse fields
    under 'args' (as a flat dict)."""
    config = state.get("config")
    if config is None and isinstance(state.get("args"), argparse.Namespace):
        return dict(vars(state["args"]))
    return config

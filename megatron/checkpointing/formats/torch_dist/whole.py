"""A torch_dist checkpoint (Megatron-LM's or ours) read whole in one process, into a
``FullCheckpoint`` (tools/checkpoint/convert.py's ``--loader megatron`` / ``--loader core``).

The model comes out under our full names (tp 1, one stage), the optimizer state, where the
checkpoint holds it in model space (ours; Megatron-LM's plain optimizer and its
``fully_reshardable`` distributed one), in ``optim_state``'s full form. The folder format is
``megatron/checkpointing/formats/torch_dist/checkpoint.py``'s; this module only asks for whole tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Optional

import torch

from megatron.checkpointing.contents import consumed_samples
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.folder import CheckpointFolder
from megatron.checkpointing.formats.torch_dist import checkpoint as fmt
from megatron.checkpointing.formats.torch_dist import dcp, mcore_buckets, mcore_router, optim
from megatron.checkpointing.formats.torch_dist.mcore_layout import (
    Place,
    full_places,
    optimizer_key,
    whole_model_shapes,
)
from megatron.checkpointing.full_state import FullCheckpoint, model_config_from_dict, source_config
from megatron.config import ModelConfig
from megatron.model.names import is_buffer

logger = logging.getLogger(__name__)


def _whole(place: Place, shape: torch.Size, dtype: torch.dtype) -> dcp.Piece:
    tensor = torch.zeros(shape, dtype=dtype)
    return dcp.Piece(place.key, place.global_shape, place.offset, place.unsqueezed(tensor))


def _param_groups(common: dict) -> list[dict]:
    """The optimizer's param-group hyper-parameters, as ours: saved by us, or Megatron-LM's
    first group's given to our two groups (weight-decayed, then not; the schedule sets lr and
    weight decay from its own state anyway)."""
    opt = common.get("optimizer")
    if isinstance(common.get("config"), dict) and isinstance(opt, dict):
        return copy.deepcopy(opt["param_groups"])
    found = []

    def walk(value) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("param_groups"), list):
                found.extend(g for g in value["param_groups"] if isinstance(g, dict))
            for v in value.values():
                walk(v)
    walk(opt)
    hyper = {k: v for k, v in (found[0] if found else {}).items()
             if k not in ("params", "step", "wd_mult", "lr_mult")}
    return [{**hyper, "wd_mult": 1.0, "lr_mult": 1.0}, {**hyper, "wd_mult": 0.0, "lr_mult": 1.0}]


def _distributed(common: dict, config: dict) -> bool:
    if isinstance(common.get("config"), dict):
        return bool(config.get("optimizer", {}).get("use_distributed_optimizer"))
    return bool(getattr(common.get("args"), "use_distributed_optimizer", False))


def load_torch_dist_checkpoint(folder: CheckpointFolder, *, verify: bool = True,
                               true_vocab_size: Optional[int] = None,
                               optimizer: bool = True) -> FullCheckpoint:
    """Read the torch_dist checkpoint ``folder`` whole (model, and the optimizer state when
    ``optimizer`` and the checkpoint holds it in model space)."""
    iter_dir, release = folder.path, folder.release
    if verify:
        folder.verify(checksums=True)
    common = fmt.read_common(iter_dir)
    try:
        config = source_config(common, not isinstance(common.get("config"), dict),
                               true_vocab_size, iter_dir)
    except ValueError as error:
        raise CheckpointError(f"{iter_dir}: {error}") from None
    model_config = model_config_from_dict(config["model"])
    shapes = whole_model_shapes(model_config)
    places = full_places(shapes, model_config.num_layers, model_config)
    metadata = dcp.read_metadata(iter_dir)
    fmt.check_model_keys(metadata, list(places.values()), model_config, iter_dir)
    # Buffers (the routers' expert biases) are fp32 whatever the parameters' type.
    model = {n: _whole(places[n], s, torch.float32 if is_buffer(n) else model_config.params_dtype)
             for n, s in shapes.items()}
    router_biases = mcore_router.stored_bias_pieces(metadata)
    pieces = list(model.values()) + router_biases
    param_state, copies, objects = None, (), []
    if optimizer and not release:
        layout = _bucket_layout_or_none(metadata, common, model_config, iter_dir)
        if layout:
            param_state, bucket_pieces, copies = _bucket_requests(layout, metadata, places,
                                                                  shapes, iter_dir)
            pieces += bucket_pieces
            objects = [k for k in [mcore_buckets.step_object_key(metadata)] if k]
        else:
            param_state = _optimizer_requests(metadata, places, shapes)
            pieces += [p for entry in (param_state or {}).values() for p in entry.values()]
            shifted = mcore_buckets.shifted_model_space_state(common)
            if param_state and shifted:
                logger.warning("%s: %s", iter_dir, shifted)
    read_objects = dcp.read_pieces(iter_dir, pieces, objects)
    mcore_router.refuse_learnt_biases(router_biases, iter_dir)
    for target, value in copies:
        target.copy_(value)
    for key in objects:
        common = optim.with_bucket_step(common, fmt.load_object(read_objects[key], key))
    full_opt = None
    if param_state:
        full_opt = {"param_groups": _param_groups(common), "step": optim.saved_step(common),
                    "param_state": {n: {_kind(k): _unstack(places[n], p)
                                        for k, p in e.items()} for n, e in param_state.items()},
                    "grad_scaler": (common.get("optimizer") or {}).get("grad_scaler")}
    elif optimizer and not release:
        logger.info("%s holds no optimizer state in model space: converting the model only",
                    iter_dir)
    train, valid = consumed_samples(common)
    return FullCheckpoint(
        config=config, model={n: _unstack(places[n], p) for n, p in model.items()},
        optimizer=full_opt, iteration=0 if release else int(common.get("iteration", 0)),
        consumed_train_samples=train, consumed_valid_samples=valid,
        scheduler=common.get("opt_param_scheduler"), extra=fmt.extra_entries(common),
        release=release, distributed_optimizer=_distributed(common, config))


def _unstack(place: Place, piece: dcp.Piece) -> torch.Tensor:
    return place.squeezed(piece.tensor)


def _kind(kind: str) -> str:
    return "param" if kind in ("param", "fp32_param") else kind


def _optimizer_requests(metadata, places: dict[str, Place],
                        shapes: dict[str, torch.Size]) -> Optional[dict]:
    """Per parameter, the whole fp32 tensor of each optimizer state kind stored for it; None
    when the checkpoint holds none in model space."""
    out = {}
    for name, place in places.items():
        kinds = optim.optimizer_kinds(metadata, place.key)
        if "param" in kinds and "fp32_param" in kinds:
            kinds.remove("fp32_param")
        if kinds:
            out[name] = {k: _whole(_state_place(place, k), shapes[name], torch.float32)
                         for k in kinds}
    if not out:
        return None
    missing = sorted(set(places) - set(out))
    if missing:
        raise CheckpointError(f"the checkpoint holds optimizer state for some parameters "
                              f"but not for {', '.join(missing[:5])}")
    return out


def _bucket_layout_or_none(metadata, common: dict, model_config: ModelConfig,
                           iter_dir: str) -> Optional[mcore_buckets.BucketLayout]:
    """Megatron-LM's dp_reshardable buckets laid out; a conversion goes on without them
    (the model only, said in the log) when they cannot be."""
    try:
        return mcore_buckets.bucket_layout(metadata, common, model_config, iter_dir)
    except mcore_buckets.BucketLayoutError as error:
        logger.warning("%s: converting the model only: its optimizer state is in Megatron-LM's "
                       "dp_reshardable buckets, and %s", iter_dir, error.why)
        return None


def _bucket_requests(layout, metadata, places: dict[str, Place], shapes: dict[str, torch.Size],
                     where: str) -> tuple[dict, list[dcp.Piece], list]:
    """Whole fp32 tensors of each state kind per parameter, read from Megatron-LM's
    dp_reshardable buckets: (the tensors by name and kind, the pieces, the copies to make)."""
    reads = mcore_buckets.BucketReads(layout, metadata, where)
    out = {}
    for name, place in places.items():
        out[name] = {}
        for kind in layout.kinds:
            whole = _whole(_state_place(place, kind), shapes[name], torch.float32)
            reads.request(kind, place, place.offset, whole.tensor)
            out[name][kind] = whole
    pieces, copies = reads.pieces()
    return out, pieces, copies


def _state_place(place: Place, kind: str) -> Place:
    """The place of optimizer state ``kind`` of a parameter: its own key, same layout."""
    return dataclasses.replace(place, key=optimizer_key(kind, place.key))

"""Megatron-LM's ``torch_dist`` checkpoint folder, written and read by every rank at once.

On disk (Megatron-LM's ``--ckpt-format torch_dist``, megatron-core's ``dist_checkpointing``
on ``torch.distributed.checkpoint``)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/metadata.json      {"sharded_backend": "torch_dist", ...}: the format
    SAVE/iter_0000100/common.pt          what is not sharded: args, iteration, schedule, ...
    SAVE/iter_0000100/.metadata          DCP's index of every global tensor and object
    SAVE/iter_0000100/__R_N.distcp       rank R's shards
    SAVE/iter_0000100/manifest.json      ours (see manifest.py); not in Megatron-LM's

The tensors are megatron-core's global, layout-free tensors (``mcore_layout.py``), so a
checkpoint loads at any tensor / pipeline / data-parallel size without a conversion step.
Each rank writes only what it holds (data-parallel rank 0 of each (tensor, pipeline) rank the
model; every data-parallel rank its distributed-optimizer shards) and reads only what it
needs; nothing is gathered.

Optimizer state is stored per parameter in model space, as megatron-core names it
(``optim.py``); a distributed-optimizer shard is a flat range of a parameter,
stored as the few boxes that range covers (``dcp.flat_boxes``). The random generators of each
(tensor, pipeline) rank, one entry per data-parallel rank, are the object
``rng_state/shard_{pp}.{tp}_{PP}.{TP}``.

``common.pt`` holds Megatron-LM's entries (``args``: an argparse Namespace with Megatron-LM's
flag names; ``checkpoint_version``, ``iteration``, ``opt_param_scheduler``,
``num_floating_point_operations_so_far``) and ours (``config``, ``parallel_layout``,
``consumed_*_samples``). Megatron-LM's own checkpoints (no ``config``) are read through their
``args``. Their distributed-optimizer state in the default ``dp_reshardable`` layout (flat
buckets of megatron-core's own buffers) is read through ``mcore_buckets`` for dense models;
for models with experts such a load asks for ``--no-load-optim``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from megatron.checkpointing.contents import (
    CONVERTED_KEY,
    RESERVED_KEYS,
    ModelChunks,
    as_chunks,
    config_dict,
    consumed_samples,
    parallel_layout_dict,
)
from megatron.checkpointing.contents import stored_config as contents_stored_config
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import (
    FileDigest,
    _legacy_safe_globals,
    file_digest,
    write_text_atomic,
    write_torch,
)
from megatron.checkpointing.format import SaveRequest
from megatron.checkpointing.formats.torch_dist import dcp, mcore_buckets, mcore_router, optim
from megatron.checkpointing.formats.torch_dist.mcore_layout import (
    Place,
    chunk_places,
    first_replica,
    layer_extra_state_keys,
    local_layers,
    local_views,
    rng_key,
)
from megatron.checkpointing.model_shape import check_model_shape
from megatron.checkpointing.paths import CHECKPOINT_VERSION
from megatron.checkpointing.publish import PublishedSave, make_tmp_dir
from megatron.checkpointing.ranks import RankLayout, all_true, raise_together
from megatron.checkpointing.rng import restore_rng_state
from megatron.checkpointing.run_config import config_from_stored
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.core.nonfinite import first_nonfinite_of
from megatron.core.optimizer.optimizer import shards_state
from megatron.model.names import EXPERT_BIAS

logger = logging.getLogger(__name__)

FORMAT = "torch_dist"
COMMON_FILENAME = "common.pt"
BACKEND_FILENAME = "metadata.json"
_BACKEND = {"sharded_backend": FORMAT, "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
# common.pt entries read here (the rest are the caller's ``extra``).
COMMON_KEYS = RESERVED_KEYS | {"content_metadata", "rerun_state_machine", "model", "model0"}


def recognise(iter_dir: str) -> bool:
    try:
        return is_torch_dist(iter_dir)
    except CheckpointError:
        return False  # another distributed backend: not ours to read


def folder_layout(iter_dir: str) -> tuple[int, int]:
    return saved_layout(read_common(iter_dir))


def folder_config(iter_dir: str) -> Optional[dict]:
    return stored_config(read_common(iter_dir), iter_dir)


def is_torch_dist(iter_dir: str) -> bool:
    """Whether ``iter_dir`` is a torch_dist checkpoint (its ``metadata.json`` says so); a
    folder of another distributed backend (Megatron-LM's old ``zarr``) is refused."""
    path = os.path.join(iter_dir, BACKEND_FILENAME)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    if backend != FORMAT:
        raise CheckpointError(f"{iter_dir} is a distributed checkpoint of the {backend!r} "
                              f"backend; only {FORMAT} is read (re-save it with Megatron-LM's "
                              f"--ckpt-format {FORMAT})")
    return True


# Reading common.pt ---------------------------------------------------------------------------


class OpaqueValue:
    """Stands in for an object of a class this process does not import (Megatron-LM keeps
    enums and dataclasses of megatron-core in its ``args``); nothing of it runs on load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.args!r}>"


def _stand_ins(path: str) -> list:
    """Stand-in classes for the globals a pickled file names that the safe loader refuses."""
    known = {f"{g[0].__module__}.{g[0].__qualname__}" if isinstance(g, tuple) else
             f"{g.__module__}.{g.__qualname__}" for g in _legacy_safe_globals()}
    out = []
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
        if name not in known:
            out.append((type(name.rsplit(".", 1)[-1], (OpaqueValue,), {}), name))
    return out


def read_common(iter_dir: str) -> dict:
    """``common.pt`` of a torch_dist folder, read without running code from it (tensors,
    plain values, argparse.Namespace, numpy; any other class becomes an ``OpaqueValue``)."""
    path = os.path.join(iter_dir, COMMON_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"torch_dist checkpoint {iter_dir} has no {COMMON_FILENAME}")
    try:
        allowed = _legacy_safe_globals() + _stand_ins(path)
        with torch.serialization.safe_globals(allowed):
            common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - zipfile, pickle and torch errors all mean "bad"
        raise CheckpointError(f"cannot read checkpoint file {path}: it is truncated, corrupt "
                              f"or not a torch file ({type(error).__name__}: "
                              f"{str(error)[:300]})") from error
    if not isinstance(common, dict):
        raise CheckpointError(f"{path} holds a {type(common).__name__}, not a dict")
    return common


def stored_config(common: dict, where: str) -> dict:
    """The run configuration of a torch_dist checkpoint as ours (``{"model": ..., ...}``):
    ours from ``config``, Megatron-LM's mapped from ``args``."""
    try:
        return config_from_stored(contents_stored_config(common),
                                  not isinstance(common.get("config"), dict), None, where)
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from None


def load_object(data: bytes, what: str) -> Any:
    try:
        with torch.serialization.safe_globals(_legacy_safe_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - report which object
        raise CheckpointError(f"cannot read {what}: {error}") from error


def _object_bytes(value: Any) -> bytes:
    """A DCP byte object as megatron-core writes one: ``torch.save`` of a list holding the
    values of the rank's objects of that name (one)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# Writing -------------------------------------------------------------------------------------


def _model_pieces(chunks: list[nn.Module], config: Any, layout: RankLayout) -> list[dcp.Piece]:
    """The model pieces this rank writes: what it holds of each tensor that no rank before
    it (over data parallelism; tensor replicas: ``Place.writer``) holds too."""
    pieces, ep = [], config.model.expert_model_parallel_size
    for chunk in chunks:
        for _, param, place in chunk_places(unwrap_model(chunk), config.model.num_layers,
                                            layout.tp_rank, layout.tp_size):
            if place.writer and first_replica(param, layout.dp_rank, ep):
                pieces += [dcp.Piece(place.key, place.global_shape, offset, view)
                           for offset, view in local_views(place, param.detach())]
    return pieces


def _extra_state_objects(chunks: list[nn.Module], config: Any) -> dict[str, bytes]:
    # megatron-core's local layers keep None (one object per layer and linear layer).
    none = _object_bytes([None])
    return {key: none for chunk in chunks for layer in local_layers(unwrap_model(chunk))
            for key in layer_extra_state_keys(layer, config)}


def _zero_router_biases(chunks: list[nn.Module], config: Any) -> list[dcp.Piece]:
    layers = [layer for chunk in chunks for layer in local_layers(unwrap_model(chunk))]
    return mcore_router.zero_bias_pieces(config, layers)


def _places_by_param(chunks: list[nn.Module], num_layers: int,
                     layout: RankLayout) -> dict[tuple[int, str], tuple[nn.Parameter, Place]]:
    return {(i, name): (param, place) for i, chunk in enumerate(chunks)
            for name, param, place in chunk_places(unwrap_model(chunk), num_layers,
                                                   layout.tp_rank, layout.tp_size)}


def megatron_args(config: Any, layout: RankLayout, iteration: int,
                  consumed: tuple[int, int]) -> argparse.Namespace:
    """Megatron-LM's ``args`` for a checkpoint of ours: the model, layout, tokenizer and
    counters under Megatron-LM's flag names (so its ``--use-checkpoint-args`` and tools read
    them)."""
    m, d = config.model, config.data
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
        num_query_groups=m.query_groups, group_query_attention=m.group_query_attention,
        seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings,
        padded_vocab_size=m.padded_vocab_size, vocab_size=m.vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        norm_epsilon=m.layernorm_epsilon, normalization=m.normalization,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        rotary_percent=m.rotary_percent, rotary_base=m.rotary_base,
        rotary_interleaved=m.rotary_interleaved, use_rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias,
        openai_gelu=m.activation == "gelu_tanh", bias_gelu_fusion=False, swiglu=m.swiglu,
        bias_swiglu_fusion=False,
        fp16=m.fp16, bf16=m.bf16, params_dtype=m.params_dtype,
        tensor_model_parallel_size=layout.tp_size, pipeline_model_parallel_size=layout.pp_size,
        data_parallel_size=layout.dp_size,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
        ckpt_format=FORMAT, iteration=iteration, consumed_train_samples=consumed[0],
        consumed_valid_samples=consumed[1], tokenizer_type=d.tokenizer_type,
        vocab_file=d.vocab_file, merge_file=d.merge_file, seed=config.training.seed,
        **_moe_args(m, layout))


def _moe_args(m: Any, layout: RankLayout) -> dict:
    """Megatron-LM's mixture-of-experts args of ``ModelConfig`` ``m`` (none for a dense
    model); its ``moe_layer_freq`` is a number or the per-layer list."""
    if m.num_experts is None:
        return {}
    freq = m.moe_layer_freq.replace(" ", "")
    return dict(
        num_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_layer_freq=int(freq) if freq.isdigit() else [int(x) for x in m.moe_layers],
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_z_loss_coeff=m.moe_z_loss_coeff,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_token_drop_policy=m.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.tp_size)


def _megatron_rng(entry: dict) -> dict:
    """Our captured generator state in Megatron-LM's own form (tuples and a numpy array), so
    its loader restores it too; ``rng.restore_rng_state`` takes both."""
    import numpy as np

    version, internal, gauss = entry["random_rng_state"]
    np_state = entry["np_rng_state"]
    keys = np_state["keys"].numpy().astype(np.uint32)
    return {**entry, "random_rng_state": (version, tuple(internal), gauss),
            "np_rng_state": (np_state["algorithm"], keys, np_state["pos"],
                             np_state["has_gauss"], np_state["cached_gaussian"])}


def _common(iteration: int, chunks: list[nn.Module], optimizer: Any, scheduler: Any,
            config: Any, layout: RankLayout, consumed: tuple[int, int], extra: Optional[dict],
            optimizer_common: Optional[dict]) -> dict:
    common: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration),
        "args": megatron_args(config, layout, iteration, consumed),
        "config": config_dict(config), "parallel_layout": parallel_layout_dict(layout,
                                                                            len(chunks)),
        "consumed_train_samples": int(consumed[0]),
        "consumed_valid_samples": int(consumed[1]),
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }
    if optimizer_common is not None:
        common["optimizer"] = optimizer_common
        if shards_state(optimizer):
            common["content_metadata"]["distrib_optim_sharding_type"] = "fully_reshardable"
    if scheduler is not None and not config.checkpoint.no_save_optim:
        common["opt_param_scheduler"] = scheduler.state_dict()
    common.update(extra or {})
    return common


class PreparedSave(NamedTuple):
    """This rank's part of a save, ready to write: its pieces (views of the live tensors, or
    host copies), byte objects, and on global rank 0 the ``common.pt`` dict."""

    pieces: list
    objects: dict
    common: Optional[dict]


def prepare_save(iteration: int, model_chunks: ModelChunks, optimizer: Any, scheduler: Any,
                 config: Any, layout: RankLayout, rng_states: Optional[list[dict]],
                 consumed: tuple[int, int], extra: Optional[dict], *,
                 copy_to_host: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                 ) -> PreparedSave:
    """What this rank writes (every rank calls it: the distributed optimizer's step count is
    agreed over data parallel, and the ranks vote on success). ``copy_to_host``: copy each
    tensor with it (into host memory), so training may change the originals while
    ``write_save`` runs."""
    chunks = as_chunks(model_chunks)
    save_optim = optimizer is not None and not config.checkpoint.no_save_optim
    optimizer_common = optim.optimizer_common(optimizer) if save_optim else None
    pieces, objects, common, error = [], {}, None, None
    try:  # what can fail on one rank alone, decided together before DCP's collectives
        pieces += _model_pieces(chunks, config, layout)
        if layout.dp_rank == 0:
            if layout.tp_rank == 0:
                objects.update(_extra_state_objects(chunks, config.model))
                pieces += _zero_router_biases(chunks, config.model)
            if rng_states is not None:
                key = rng_key(layout.pp_rank, layout.tp_rank, layout.pp_size, layout.tp_size)
                objects[key] = _object_bytes([[_megatron_rng(e) for e in rng_states]])
        if save_optim:
            places = _places_by_param(chunks, config.model.num_layers, layout)
            pieces += optim.optimizer_pieces(optimizer, chunks, places, layout.dp_rank,
                                             config.model.expert_model_parallel_size)
        if copy_to_host is not None:
            pieces = [p.with_tensor(copy_to_host(p.tensor)) for p in pieces]
        if layout.rank == 0:
            common = _common(iteration, chunks, optimizer, scheduler, config, layout, consumed,
                             extra, optimizer_common)
    except Exception as e:  # noqa: BLE001 - every rank must reach the vote
        error = e
    raise_together(error)
    return PreparedSave(pieces, objects, common)


def write_save(folder: str, prepared: PreparedSave,
               process_group: Optional[Any] = None) -> dict[str, FileDigest]:
    """Write a prepared save into ``folder`` (a collective over ``process_group``, default
    all ranks: a background writer passes a group of its own). Returns the digests of the
    files this rank wrote, by name."""
    digests = dcp.write_pieces(folder, prepared.pieces, prepared.objects, process_group)
    if prepared.common is not None:
        digests[COMMON_FILENAME] = write_torch(prepared.common,
                                               os.path.join(folder, COMMON_FILENAME))
        write_text_atomic(os.path.join(folder, BACKEND_FILENAME), json.dumps(_BACKEND))
        digests[BACKEND_FILENAME] = file_digest(os.path.join(folder, BACKEND_FILENAME))
    return digests


def save_files(folder: str, iteration: int, model_chunks: ModelChunks, optimizer: Any,
               scheduler: Any, config: Any, layout: RankLayout,
               rng_states: Optional[list[dict]], consumed: tuple[int, int],
               extra: Optional[dict]) -> dict[str, FileDigest]:
    """Write this rank's part of a torch_dist checkpoint into ``folder`` now (every rank
    calls it; a collective). Returns the digests of the files this rank wrote, by name."""
    return write_save(folder, prepare_save(iteration, model_chunks, optimizer, scheduler,
                                           config, layout, rng_states, consumed, extra))


@dataclasses.dataclass
class TorchDistSaveJob(PublishedSave):
    """One torch_dist save (a ``SaveJob``, see async_save.py): this rank's prepared part,
    written by ``write`` (in the background over ``group``, the saver's own gloo group)."""

    prepared: Optional[PreparedSave] = None
    group: Any = None
    refuse_nonfinite: bool = False  # checked on the (host) copy, in write

    def write(self) -> dict[str, FileDigest]:
        if self.refuse_nonfinite:
            named = [(f"{p.key} (the box at {list(p.offset)})", p.tensor)
                     for p in self.prepared.pieces if p.tensor.is_floating_point()]
            what = first_nonfinite_of(named)
            # Decided together: a rank that stopped here would leave the others waiting in
            # DCP's collectives.
            if not _all_true_over(what is None, self.group):
                self.prepared = None
                raise CheckpointError(
                    f"refusing to save the checkpoint of iteration {self.iteration}: "
                    + (f"{what} holds NaN/Inf" if what else "another rank's state holds NaN/Inf"))
        digests = write_save(self.tmp_dir, self.prepared, self.group)
        self.prepared = None  # a background save frees its host copies
        return digests


def _all_true_over(flag: bool, group: Any) -> bool:
    """``ranks.all_true`` over ``group`` (a background writer's own gloo group: host
    tensors), or over all ranks when it is None."""
    if group is None or not torch.distributed.is_initialized():
        return all_true(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(t.item())


def start_save(request: SaveRequest) -> TorchDistSaveJob:
    """A torch_dist save of this rank (every rank calls it): the state taken now (into the
    saver's host buffers when there is a ``saver``: ``--async-save``), the folder made; the
    caller writes and publishes it (``async_save.run_job`` or ``saver.start``).
    ``refuse_nonfinite``: the write fails, naming the tensor, if a piece holds NaN/Inf."""
    r = request
    copy = r.saver.buffers.copy if r.saver is not None else None
    prepared = prepare_save(r.iteration, r.chunks, r.optimizer, r.scheduler, r.config,
                            r.layout, r.rng_states, r.consumed, r.extra, copy_to_host=copy)
    save_dir = r.config.checkpoint.save
    return TorchDistSaveJob(
        iteration=r.iteration, save_dir=save_dir,
        tmp_dir=make_tmp_dir(save_dir, r.iteration, r.layout),
        manifest_layout=parallel_layout_dict(r.layout, len(r.chunks)),
        config=config_dict(r.config), checkpoint=r.config.checkpoint, valid_loss=r.valid_loss,
        prepared=prepared, group=r.saver.group if r.saver is not None else None,
        refuse_nonfinite=r.refuse_nonfinite)


# Reading -------------------------------------------------------------------------------------


class TorchDistState(NamedTuple):
    """What ``read_into`` restored, for the caller's report."""

    common: dict
    optimizer: bool  # optimizer state restored
    scheduler: bool
    rng: bool


def check_model_keys(metadata: Any, places: list[Place], model_config: Any,
                      where: str) -> None:
    """Every tensor this rank needs is stored with the shape this model has (the
    vocabulary may be padded otherwise; it must hold this run's vocabulary)."""
    stored_keys = set(metadata.state_dict_metadata)
    problems = []
    if "output_layer.weight" in stored_keys and not model_config.untie_embeddings_and_output_weights:
        problems.append("it has its own output layer: add --untie-embeddings-and-output-weights")
    if not getattr(model_config, "moe_router_enable_expert_bias", False) \
            and any(k.endswith(f".{EXPERT_BIAS}") for k in stored_keys):
        problems.append("its routers have expert biases: add --moe-router-enable-expert-bias "
                        "(with --moe-router-score-function sigmoid)")
    for p in places:
        shape = dcp.stored_shape(metadata, p.key)
        if shape is None:
            hint = (": it was saved with tied embeddings, drop "
                    "--untie-embeddings-and-output-weights" if p.key == "output_layer.weight"
                    else "")
            problems.append(f"it has no tensor {p.key!r}{hint}")
        elif p.key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if shape[1:] != p.global_shape[1:] or shape[0] < model_config.vocab_size:
                problems.append(f"{p.key!r} has shape {list(shape)}, this model needs "
                                f"[>= {model_config.vocab_size}, {p.global_shape[1]}] (vocabulary "
                                f"{model_config.vocab_size})")
        elif shape != p.global_shape:
            problems.append(f"{p.key!r} has shape {list(shape)}, this model's is "
                            f"{list(p.global_shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {where} does not fit this model: "
                              f"{'; '.join(dict.fromkeys(problems))}")


def saved_layout(common: dict) -> tuple[int, int]:
    """(tensor, pipeline) sizes the checkpoint was saved at."""
    layout = common.get("parallel_layout")
    if isinstance(layout, dict):
        return layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    args = common.get("args")
    return (int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            int(getattr(args, "pipeline_model_parallel_size", 1) or 1))


def _rng_entry(objects: dict, key: Optional[str], layout: RankLayout) -> Optional[dict]:
    if key is None or key not in objects:
        return None
    # megatron-core stores a list of the objects of that name on the writing rank: one here.
    stored = load_object(objects[key], f"the random-generator state {key}")
    entries = stored[0] if isinstance(stored, list) and len(stored) == 1 else None
    if not isinstance(entries, list) or not entries:
        return None
    return entries[layout.dp_rank] if len(entries) == layout.dp_size else entries[0]


class PreparedRead(NamedTuple):
    """What a rank reads: its pieces (into the parameters and the optimizer's read), the
    byte objects, and megatron-core's router biases (``mcore_router``: checked after)."""

    pieces: list
    optimizer: Optional[optim.OptimizerRead]
    objects: list
    router_biases: list


def prepare_read(iter_dir: str, common: dict, chunks: list[nn.Module], optimizer: Any,
                 config: Any, layout: RankLayout, load_optim: bool,
                 load_rng: bool) -> PreparedRead:
    """Check the checkpoint against this run and list what this rank reads: the model
    pieces (into the parameters), the optimizer pieces and the byte objects."""
    metadata = dcp.read_metadata(iter_dir)
    places = _places_by_param(chunks, config.model.num_layers, layout)
    check_model_keys(metadata, [p for _, p in places.values()], config.model, iter_dir)
    pieces = []
    for param, place in places.values():
        if place.key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            param.data.zero_()  # rows past the stored vocabulary are padding
        pieces += [dcp.Piece(place.key, place.global_shape, offset, view)
                   for offset, view in local_views(place, param.data)]
    read = None
    if load_optim and optimizer is not None:
        read, optimizer_pieces = optim.optimizer_requests(optimizer, chunks, places, metadata,
                                                          common, iter_dir, config.model)
        pieces += optimizer_pieces
        shifted = mcore_buckets.shifted_model_space_state(common)
        if shifted and layout.rank == 0:
            logger.warning("checkpoint %s: %s", iter_dir, shifted)
    step_key = mcore_buckets.step_object_key(metadata) if read is not None else None
    objects = [step_key] if step_key else []
    if load_rng and saved_layout(common) == (layout.tp_size, layout.pp_size):
        key = rng_key(layout.pp_rank, layout.tp_rank, layout.pp_size, layout.tp_size)
        if key in metadata.state_dict_metadata:
            objects.append(key)
    return PreparedRead(pieces, read, objects, mcore_router.stored_bias_pieces(metadata))


def read_into(iter_dir: str, common: dict, model_chunks: ModelChunks, optimizer: Any,
              scheduler: Any, config: Any, layout: RankLayout, load_optim: bool,
              load_rng: bool) -> TorchDistState:
    """Read this rank's model (and optimizer, schedule, generators when asked) from a
    torch_dist folder; every rank calls it (the read is a collective). The checks that
    can fail alone run first; callers vote on them (``prepare_read``)."""
    chunks = as_chunks(model_chunks)
    error, prepared = None, None
    try:  # checks that can fail on one rank alone, decided together before the read
        prepared = prepare_read(iter_dir, common, chunks, optimizer, config, layout, load_optim,
                                load_rng)
    except Exception as e:  # noqa: BLE001 - every rank must reach the vote
        error = e
    raise_together(error)
    pieces, read, object_keys, router_biases = prepared
    objects = dcp.read_pieces(iter_dir, pieces + router_biases, object_keys)
    mcore_router.refuse_learnt_biases(router_biases, iter_dir)
    scheduler_loaded = False
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main copies follow the loaded weights
    if read is not None:
        if mcore_buckets.STEP_OBJECT in objects:
            common = optim.with_bucket_step(common, load_object(
                objects[mcore_buckets.STEP_OBJECT],
                f"the optimizer's step object {mcore_buckets.STEP_OBJECT}"))
        optim.apply_optimizer(optimizer, read, common)
        saved = common.get("opt_param_scheduler", common.get("lr_scheduler"))
        if scheduler is not None and saved is not None and not config.checkpoint.no_load_lr_state:
            scheduler.load_state_dict(saved)
            scheduler_loaded = True
    rng = _rng_entry(objects, rng_key(layout.pp_rank, layout.tp_rank, layout.pp_size,
                                      layout.tp_size), layout)
    if rng is not None:
        restore_rng_state(rng)
    return TorchDistState(common, read is not None, scheduler_loaded, rng is not None)


def extra_entries(common: dict) -> dict:
    """``common.pt``'s entries that are not the checkpoint's own (the caller's ``extra``)."""
    return {k: v for k, v in common.items() if k not in COMMON_KEYS and k != CONVERTED_KEY
            and not re.fullmatch(r"model\d*", k)}


def counters(common: dict) -> tuple[int, int, int]:
    """(iteration, consumed train samples, consumed valid samples)."""
    if "iteration" not in common:
        raise CheckpointError("the checkpoint's common.pt has no 'iteration' entry")
    return (int(common["iteration"]), *consumed_samples(common))


def check_stored_config(common: dict, config: Any, where: str) -> dict:
    """The checkpoint's configuration (ours), after checking its model flags against this
    run's (the vocabulary only by its unpadded size: padding follows the tensor-parallel
    size, which may change)."""
    saved = stored_config(common, where)
    model = dict(saved.get("model", {}))
    vocab = model.pop("vocab_size", None)
    for key in ("padded_vocab_size", "make_vocab_size_divisible_by"):
        model.pop(key, None)
    check_model_shape({"model": model}, config.model, where)
    if isinstance(common.get("config"), dict) and vocab is not None \
            and vocab != config.model.vocab_size:
        raise CheckpointError(f"checkpoint {where} has a vocabulary of {vocab}, you asked for "
                              f"{config.model.vocab_size} (--vocab-size or the tokenizer's)")
    return saved


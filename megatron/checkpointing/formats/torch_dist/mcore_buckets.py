"""Megatron-LM's default distributed-optimizer state (``dp_reshardable``), read in model space.

Megatron-LM saves its distributed optimizer's state, unless asked for
``--dist-ckpt-optim-fully-reshardable``, as the flat buffers its data-parallel ranks step: per
model-parallel rank ``d`` (tensor rank + tp x pipeline rank), per gradient buffer and bucket,
one 1-D tensor per state kind (``param``: the fp32 main weights, ``exp_avg``, ``exp_avg_sq``)::

    optimizer.distributed.dp_group_idx_<d>.gbuf_idx_0.dtype_(<param>, <grad>).bucket_idx_<b>.exp_avg

as long as the bucket without its final padding. Nothing in the checkpoint names the
parameters of a bucket: megatron-core's buffer places them by its own rule, which is rebuilt
here. A model-parallel rank's parameters go into its buffer in reverse order of its modules'
``named_parameters()``, each starting at a multiple of 64 elements, and a bucket closes where
its stored length ends (that length is the stored tensor's size). The layout is then checked
against the stored chunks: every parameter's state was written as a chunk of its own, so each
parameter must start and end on a chunk boundary. A wrong rule fails that check rather than
reading shifted values (parameters of equal size that swapped places would pass it; the
module order below is megatron-core 0.16's).

The tensor-parallel cut of each parameter is ours (``megatron/model/placement.py``), so a rebuilt
entry says where its range of the bucket sits in the global (model-space) tensor, and a
reader asks for exactly the part each of its slots needs, through DCP: no rank reads more than
the state it keeps, plus the rows of partly needed parameters. Tensor replicas (layer norms,
row-parallel biases) and the last stage's copy of tied embeddings are read from one owner.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple, Optional

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.torch_dist import dcp
from megatron.checkpointing.formats.torch_dist.mcore_layout import Place, place, whole_model_shapes
from megatron.model.names import (
    OUTPUT_LAYER,
    TIED_COPY,
    WORD_EMBEDDINGS,
    layer_key,
    tp_parts,
    tp_split_dim,
)
from megatron.model.placement import pipeline_chunks

_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)"
                     r"\.bucket_idx_(\d+)\.([A-Za-z_]+)")
PARAM_ALIGNMENT = 64  # megatron-core starts each parameter at a multiple of 64 elements
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = ("final_layernorm.weight", "final_layernorm.bias")
# One transformer layer's parameters in megatron-core's named_parameters() order, by our
# names. Its local layer spec keeps its own layer norms before the attention; the Transformer
# Engine spec fuses them into linear_qkv / linear_fc1 (TE registers layer_norm_weight,
# layer_norm_bias, weight, bias), which megatron-core's Attention builds after linear_proj.
_ATTENTION_OUT = ("self_attention.dense.weight", "self_attention.dense.bias")
_INPUT_NORM = ("input_layernorm.weight", "input_layernorm.bias")
_REST = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
         "post_attention_layernorm.weight", "post_attention_layernorm.bias",
         "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
         "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")
LAYER_ORDER = {"local": _INPUT_NORM + _ATTENTION_OUT + _REST,
               "transformer_engine": _ATTENTION_OUT + _INPUT_NORM + _REST}


# The byte object holding megatron-core's optimizer step and hyper-parameters (its
# DistributedOptimizer.state_dict() of model-parallel rank 0; the same on every rank).
STEP_OBJECT = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"


def step_object_key(metadata: Any) -> Optional[str]:
    """``STEP_OBJECT`` where the checkpoint holds it, else None."""
    return STEP_OBJECT if STEP_OBJECT in metadata.state_dict_metadata else None


def shifted_model_space_state(common: dict) -> Optional[str]:
    """Why the per-parameter optimizer state of a Megatron-LM checkpoint saved with
    ``--dist-ckpt-optim-fully-reshardable`` is likely shifted, or None. megatron-core 0.16.1
    (at least) gathers a rank's buckets without the padding between them but cuts parameters
    at their padded offsets, so every parameter after the rank's first bucket gets state of
    its neighbours (checked here against its own in-memory state; it warns "param range exceeds
    unpadded buffer" once, for the last one). A rank has several buckets when its run overlapped
    the gradient reduction or kept tied embeddings on two pipeline stages."""
    meta = common.get("content_metadata") or {}
    args = common.get("args")
    if meta.get("distrib_optim_sharding_type") != "fully_reshardable" or args is None \
            or not getattr(args, "use_distributed_optimizer", False):
        return None
    tied_over_stages = (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1 \
        and not getattr(args, "untie_embeddings_and_output_weights", False)
    if not (getattr(args, "overlap_grad_reduce", False) or tied_over_stages):
        return None
    return ("its distributed-optimizer state was saved by megatron-core's fully_reshardable "
            "writer from several buckets per rank, which stores the state of the parameters "
            "after a rank's first bucket shifted onto their neighbours (megatron-core 0.16.1 "
            "does); the moments read may be misplaced. Its default dp_reshardable form is read "
            "exactly; or pass --no-load-optim")


class Entry(NamedTuple):
    """One parameter's state in a bucket: the range ``[start, start + numel)`` of the 1-D
    tensors ``<bucket>.<kind>``, which holds the model-parallel rank's part of the global
    tensor at ``place`` (``shape``: that part's local shape)."""

    bucket: str
    start: int
    shape: tuple[int, ...]
    place: Place

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class BucketLayoutError(CheckpointError):
    """The buckets cannot be laid out for this model; ``why`` says why."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"checkpoint {where}: its distributed-optimizer state is in "
                         f"Megatron-LM's dp_reshardable buckets, and {why}. Pass "
                         "--no-load-optim to continue with a fresh optimizer (and the LR "
                         "schedule from your flags), or --finetune to start at iteration 0")
        self.why = why





class _Run(NamedTuple):
    """What of Megatron-LM's args sets the bucket layout."""

    tp: int
    pp: int
    first_stage_layers: Optional[int]
    last_stage_layers: Optional[int]
    layer_order: tuple[str, ...]


def _run_settings(common: dict, where: str) -> _Run:
    args = common.get("args")
    if args is None:
        raise BucketLayoutError(where, "its common.pt has no Megatron-LM args to lay them out by")

    def arg(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    if (arg("virtual_pipeline_model_parallel_size") or 1) > 1 \
            or arg("num_layers_per_virtual_pipeline_stage"):
        raise BucketLayoutError(where, "its run used virtual pipeline stages, whose buckets "
                                "are not laid out here")
    for name in ("context_parallel_size", "expert_model_parallel_size"):
        if (arg(name) or 1) > 1:
            raise BucketLayoutError(where, f"its run used --{name.replace('_', '-')} {arg(name)}, "
                                    "whose buckets are not laid out here")
    impl = arg("transformer_impl", "transformer_engine")
    if impl not in LAYER_ORDER:
        raise BucketLayoutError(where, f"its --transformer-impl {impl!r} is not known here")
    return _Run(int(arg("tensor_model_parallel_size", 1) or 1),
                int(arg("pipeline_model_parallel_size", 1) or 1),
                arg("decoder_first_pipeline_num_layers"), arg("decoder_last_pipeline_num_layers"),
                LAYER_ORDER[impl])


def _stored_buckets(metadata: Any, where: str) -> tuple[dict[int, list[tuple[str, int]]], list]:
    """Per model-parallel rank, its buckets in order as (name without the kind, length);
    and the state kinds stored."""
    found: dict[int, dict[tuple[int, int], tuple[str, int]]] = {}
    kinds = []
    for key, md in metadata.state_dict_metadata.items():
        m = _BUCKET.fullmatch(key)
        if not m:
            continue
        domain, gbuf, bucket, kind = int(m[1]), int(m[2]), int(m[4]), m[5]
        if kind not in kinds:
            kinds.append(kind)
        found.setdefault(domain, {})[(gbuf, bucket)] = (key[:-len(kind) - 1], int(md.size[0]))
    out = {}
    for domain, buckets in found.items():
        if {g for g, _ in buckets} != {0}:
            raise BucketLayoutError(where, "it has several gradient buffers per rank (expert "
                                    "or FP8 parameters), which are not laid out here")
        out[domain] = [buckets[k] for k in sorted(buckets)]
    return out, kinds


def _domain_order(shapes: dict, run: _Run, num_layers: int, pp_rank: int) -> list[tuple]:
    """(our name, global layer or None) of one pipeline stage's parameters, in
    megatron-core's named_parameters() order."""
    stage = pipeline_chunks(num_layers, run.pp, None, run.first_stage_layers,
                            run.last_stage_layers)[pp_rank][0]
    order: list[tuple] = []
    if stage.pre_process:
        order += [(n, None) for n in (WORD_EMBEDDINGS, POSITIONS) if n in shapes]
    for layer in range(stage.first_layer, stage.first_layer + stage.num_layers):
        order += [(layer_key(layer, s), layer) for s in run.layer_order
                  if layer_key(layer, s) in shapes]
    if stage.post_process:
        order += [(n, None) for n in FINAL_NORM if n in shapes]
        if OUTPUT_LAYER in shapes:
            order.append((OUTPUT_LAYER, None))
        elif not stage.pre_process:  # the last stage's own copy of tied embeddings
            order.append((TIED_COPY, None))
    return order


def _local_shape(name: str, shapes: dict, stored_vocab: int, tp: int,
                 where: str) -> tuple[int, ...]:
    shape = list(shapes[WORD_EMBEDDINGS if name == TIED_COPY else name])
    if name in (WORD_EMBEDDINGS, TIED_COPY, OUTPUT_LAYER):
        shape[0] = stored_vocab
    dim = tp_split_dim(name)
    if dim is not None:
        if shape[dim] % tp:
            raise BucketLayoutError(where, f"{name} ({shape}) does not split over its "
                                    f"tensor-parallel size {tp}")
        shape[dim] //= tp
    return tuple(shape)


def _lay_out(params: list[tuple], buckets: list[tuple[str, int]], domain: int,
             where: str) -> list[tuple[str, int]]:
    """megatron-core's buffer rule: (bucket, start) of each of ``params`` (its own order)."""
    lengths = [n for _, n in buckets]
    out, index, position = [], 0, 0
    for name, numel in reversed(params):
        start = -(-position // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        end = start + numel
        if index >= len(buckets) or end > buckets[index][1]:
            raise BucketLayoutError(where, f"model-parallel rank {domain}'s buckets ({lengths} "
                                    "elements) do not hold this model's parameters as "
                                    f"megatron-core lays them out (at {name})")
        out.append((buckets[index][0], start))
        if end == buckets[index][1]:
            index, position = index + 1, 0
        else:
            position = end
    if index != len(buckets):
        raise BucketLayoutError(where, f"model-parallel rank {domain}'s buckets ({lengths} "
                                "elements) hold more than this model's parameters")
    return out[::-1]


def _check_chunks(metadata: Any, entries: list[Entry], kind: str, where: str) -> None:
    """Each entry starts and ends on a stored chunk boundary (see the module docstring)."""
    bounds: dict[str, set[int]] = {}
    for e in entries:
        if e.bucket not in bounds:
            md = metadata.state_dict_metadata[f"{e.bucket}.{kind}"]
            bounds[e.bucket] = {int(c.offsets[0]) for c in md.chunks} | {int(md.size[0])}
        if e.start not in bounds[e.bucket] or e.start + e.numel not in bounds[e.bucket]:
            raise BucketLayoutError(where, f"the stored chunks of {e.bucket} do not match "
                                    f"megatron-core's layout of this model ({e.place.key} at "
                                    f"{e.start})")


class BucketLayout(NamedTuple):
    """Per global tensor name and layer (None: not a layer's), the entries that own its
    state (one per part)."""

    entries: dict[tuple[str, Optional[int]], list[Entry]]
    kinds: list[str]
    sizes: dict[str, int]  # bucket name -> length


def bucket_layout(metadata: Any, common: dict, model_config: Any,
                  where: str) -> Optional[BucketLayout]:
    """The layout of a checkpoint's dp_reshardable buckets; None when it holds none."""
    stored, kinds = _stored_buckets(metadata, where)
    if not stored:
        return None
    if model_config.num_experts is not None:
        raise BucketLayoutError(where, f"its model has experts (--num-experts "
                                f"{model_config.num_experts}), whose buffers are not laid out "
                                "here")
    run = _run_settings(common, where)
    if sorted(stored) != list(range(run.tp * run.pp)):
        raise BucketLayoutError(where, f"its buckets belong to model-parallel ranks "
                                f"{sorted(stored)}, not the {run.tp * run.pp} of tensor x "
                                f"pipeline {run.tp} x {run.pp}")
    shapes = whole_model_shapes(model_config)
    vocab_key = OUTPUT_LAYER if OUTPUT_LAYER in metadata.state_dict_metadata else WORD_EMBEDDINGS
    stored_vocab = dcp.stored_shape(metadata, vocab_key)
    stored_vocab = stored_vocab[0] if stored_vocab else shapes[WORD_EMBEDDINGS][0]
    owned: dict[tuple[str, Optional[int]], list[Entry]] = {}
    sizes = {}
    for domain, buckets in stored.items():
        sizes.update(buckets)
        tp_rank, pp_rank = domain % run.tp, domain // run.tp
        order = _domain_order(shapes, run, model_config.num_layers, pp_rank)
        local = [(n, _local_shape(n, shapes, stored_vocab, run.tp, where), layer)
                 for n, layer in order]
        starts = _lay_out([(n, math.prod(s)) for n, s, _ in local], buckets, domain, where)
        entries = [Entry(bucket, start, shape,
                         place(n, shape, layer, model_config.num_layers, tp_rank, run.tp,
                               tp_parts(n, model_config)))
                   for (n, shape, layer), (bucket, start) in zip(local, starts)]
        _check_chunks(metadata, entries, kinds[0], where)
        for e in (part for entry in entries for part in _by_part(entry)):
            if e.place.writer:
                owned.setdefault(_index(e.place), []).append(e)
    return BucketLayout(owned, kinds, sizes)


def _by_part(entry: Entry) -> list[Entry]:
    """``entry`` as one entry per part of its place: a rank's SwiGLU ``[gate_r; up_r]`` rows
    are two boxes of the global tensor, each stored contiguously in the bucket."""
    parts = entry.place.parts
    if parts is None:
        return [entry]
    half, rest = parts[0], entry.shape[1:]
    first, _ = entry.place.box((0,) * len(entry.shape), entry.shape)
    second, _ = entry.place.box((half,) + (0,) * len(rest), entry.shape)

    def at(offset: tuple) -> Place:
        return dataclasses.replace(entry.place, offset=offset, parts=None)
    return [Entry(entry.bucket, entry.start, (half, *rest), at(first)),
            Entry(entry.bucket, entry.start + half * math.prod(rest),
                  (entry.shape[0] - half, *rest), at(second))]


def _index(where: Place) -> tuple[str, Optional[int]]:
    return where.key, where.offset[0] if where.lead else None


# Reading --------------------------------------------------------------------------------------


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(sizes):
        out.append(step)
        step *= s
    return tuple(reversed(out))


class _Need(NamedTuple):
    first: int  # flat index in the entry of the box's first element
    last: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    target: torch.Tensor


class BucketReads:
    """Collects what slots need from the buckets, then turns it into DCP pieces (one span
    per entry and kind) and the copies that move the read values into the slots."""

    def __init__(self, layout: BucketLayout, metadata: Any, where: str) -> None:
        self.layout, self.metadata, self.where = layout, metadata, where
        self.needs: dict[tuple[Entry, str], list[_Need]] = {}

    def request(self, kind: str, where: Place, offset: tuple, target: torch.Tensor) -> None:
        """``target`` (the box at global ``offset`` of the parameter at ``where``) gets
        state ``kind``; the part past the stored tensor's extent (vocabulary padding) is left
        as it is."""
        key = where.key
        stored = dcp.stored_shape(self.metadata, key) or where.global_shape
        end = tuple(min(o + s, g) for o, s, g in zip(offset, target.shape, stored))
        wanted = math.prod(max(e - o, 0) for o, e in zip(offset, end))
        covered = 0
        for entry in self.layout.entries.get(_index(where), []):
            e_offset, e_sizes = entry.place.box((0,) * len(entry.shape), entry.shape)
            lo = tuple(max(a, b) for a, b in zip(offset, e_offset))
            hi = tuple(min(a, b + s) for a, b, s in zip(end, e_offset, e_sizes))
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            sizes = tuple(h - lo_ for lo_, h in zip(lo, hi))
            strides = _strides(e_sizes)
            local = tuple(lo_ - b for lo_, b in zip(lo, e_offset))
            first = sum(i * s for i, s in zip(local, strides))
            last = sum((i + n - 1) * s for i, n, s in zip(local, sizes, strides))
            box = target[tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, offset))]
            self.needs.setdefault((entry, kind), []).append(
                _Need(first, last, sizes, strides, box))
            covered += math.prod(sizes)
        if covered != wanted:
            raise BucketLayoutError(self.where, f"its buckets do not hold all of {key}'s {kind} "
                                    f"({covered} of {wanted} elements of a part this rank needs)")

    def pieces(self) -> tuple[list[dcp.Piece], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The spans to read and the (slot view, read view) copies to make after the read."""
        pieces, copies = [], []
        for (entry, kind), needs in self.needs.items():
            first = min(n.first for n in needs)
            span = torch.empty(max(n.last for n in needs) - first + 1, dtype=torch.float32)
            pieces.append(dcp.Piece(f"{entry.bucket}.{kind}", (self.layout.sizes[entry.bucket],),
                                    (entry.start + first,), span))
            copies += [(n.target, span.as_strided(n.sizes, n.strides, n.first - first))
                       for n in needs]
        return pieces, copies

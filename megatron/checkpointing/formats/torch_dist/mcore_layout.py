"""Where each of our GPT parameters lives in megatron-core's sharded checkpoint names.

megatron-core's ``GPTModel.sharded_state_dict()`` (what Megatron-LM's ``--ckpt-format
torch_dist`` saves) names *global* tensors, independent of the parallel layout:

    embedding.word_embeddings.weight                  [V_padded, h]  split over tp (rows)
    embedding.position_embeddings.weight              [s, h]         (learned positions)
    decoder.layers.self_attention.linear_qkv.weight   [L, 3h, h]     one row block per layer;
                                                                     rows split over tp
    decoder.layers.self_attention.linear_qkv.layer_norm_weight  [L, h]  our input_layernorm
    decoder.layers.mlp.linear_fc1.layer_norm_weight   [L, h]         our post_attention_layernorm
    decoder.final_layernorm.weight                    [h]
    output_layer.weight                               [V_padded, h]  untied embeddings only

Layers are stacked along a leading axis of size ``--num-layers`` (global layer numbers, so a
pipeline stage holds a slab of it). The layer norms sit in the names of the linear layer they
feed (Transformer Engine fuses them; megatron-core's local spec maps its own names to these).
The query/key/value rows are grouped per head (``[n, 3, d]``), as ours are. Tensor-parallel
cuts are ours (``megatron/model/placement.py``'s ``tp_split_dim``). With tied embeddings the last
stage's copy of the word embeddings is the same global tensor (not written twice), and there
is no ``output_layer.weight``.

Experts (``megatron/model/mcore_names.py``) add their axis after the layer's: a rank's
``local_experts.j`` is expert ``first_expert + j`` of its layer's global tensors, so a
checkpoint loads at any expert-parallel size as at any tensor size. Models whose layers
differ (``--moe-layer-freq`` other than 1) are stored one layer per name, unstacked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from megatron.core.distributed.distributed_data_parallel import is_expert
from megatron.core.tensor_parallel.layers import assume_tensor_parallel_rank
from megatron.model.gpt_model import GPTModel
from megatron.model.mcore_names import (  # noqa: F401 - LAYERS re-exported
    EXPERTS,
    LAYERS,
    SHARED_EXPERTS,
    McoreLayout,
    mcore_layout,
    mcore_tensor,
)
from megatron.model.names import (
    TIED_COPY,
    is_buffer,
    layer_key,
    parse_layer_key,
    renumber_expert,
    tp_parts,
    tp_split_dim,
)

# megatron-core keeps an ``_extra_state`` (Transformer Engine's FP8 metadata; None on its
# local layers) per linear layer of each transformer layer; its loader asks for them.
ATTENTION_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv")
MLP_EXTRA_STATE = ("linear_fc1", "linear_fc2")  # of the MLP, each expert, the shared expert
EXTRA_STATE_MODULES = ATTENTION_EXTRA_STATE + tuple(f"mlp.{m}" for m in MLP_EXTRA_STATE)
# Optimizer state of a parameter is stored under "optimizer.state.<kind>.<its key>".
OPTIMIZER_PREFIX = "optimizer.state."


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a local parameter sits: in global tensor ``key`` of ``global_shape``, at
    ``offset``; ``lead``: how many leading axes the local tensor lacks (the layer's when
    stacked, an expert's), each of size 1 at the offset; ``writer``: this tensor-parallel
    rank writes it (replicas do not)."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    lead: int
    writer: bool
    # Two parts cut on their own (SwiGLU's [gate_r; up_r] at tp > 1): (the local rows of the
    # first part, the global rows of the first part); the second part's rows lie that many
    # further on in the global tensor than the local layout puts them.
    parts: Optional[tuple[int, int]] = None

    @property
    def stacked(self) -> bool:
        """Whether the global tensor has axes the local one lacks (layers, experts)."""
        return self.lead > 0

    def unsqueezed(self, tensor: torch.Tensor) -> torch.Tensor:
        """A local tensor (or a box of it) as a box of the global tensor: its lead axes
        added."""
        return tensor[(None,) * self.lead] if self.lead else tensor

    def squeezed(self, tensor: torch.Tensor) -> torch.Tensor:
        """A box of the global tensor at the lead axes' offset as the local tensor."""
        return tensor[(0,) * self.lead] if self.lead else tensor

    def box(self, local_offset: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[tuple, tuple]:
        """The global (offset, sizes) of the local box at ``local_offset`` with ``sizes``
        (within one part)."""
        lead, rest = self.offset[:self.lead], self.offset[self.lead:]
        offset = list(a + b for a, b in zip(rest, local_offset))
        if self.parts is not None and local_offset and local_offset[0] >= self.parts[0]:
            offset[0] += self.parts[1] - self.parts[0]  # the second part's rows
        return lead + tuple(offset), (1,) * self.lead + tuple(sizes)

    def boxes(self, local_offset: tuple[int, ...],
              sizes: tuple[int, ...]) -> list[tuple[tuple, tuple, tuple, tuple]]:
        """``(global offset, global sizes, local offset, local sizes)`` of the local box at
        ``local_offset`` with ``sizes``, cut where the parts meet (one box without parts)."""
        cuts = [(tuple(local_offset), tuple(sizes))]
        if self.parts is not None and sizes:
            first, end = local_offset[0], local_offset[0] + sizes[0]
            half = self.parts[0]
            if first < half < end:
                rest = tuple(sizes[1:])
                cuts = [(tuple(local_offset), (half - first, *rest)),
                        ((half, *local_offset[1:]), (end - half, *rest))]
        return [(*self.box(o, s), o, s) for o, s in cuts]


def place(name: str, shape: tuple[int, ...], layer: Optional[int], num_layers: int,
          tp_rank: int, tp_size: int, parts: int = 1, *,
          layout: Optional[McoreLayout] = None) -> Place:
    """The place of our parameter ``name`` (chunk name; an expert's under its global number)
    of local ``shape`` on tensor rank ``tp_rank``; ``layer``: its global layer index
    (0-based) for a layer's parameter; ``parts``: how many parts the tensor-parallel cut
    takes apart (``names.tp_parts``: 2 for SwiGLU's first projection); ``layout``:
    megatron-core's layout of the model (default: a dense model of ``num_layers``)."""
    dim = tp_split_dim(name)
    full = list(shape)
    offset = [0] * len(shape)
    halves = None
    if dim is not None:
        full[dim] *= tp_size
        offset[dim] = tp_rank * shape[dim]
        if parts == 2 and tp_size > 1:
            # megatron-core's SwiGLU factory: [gate; up] globally, a rank's gate rows at
            # tp_rank * f/tp and its up rows at f + tp_rank * f/tp
            half = shape[0] // 2
            offset[0] = tp_rank * half
            halves = (half, half * tp_size)
    writer = (dim is not None or tp_rank == 0) and name != TIED_COPY
    parsed = parse_layer_key(name)
    where = mcore_tensor(layer_key(layer, parsed[1]) if parsed else name,
                         layout or McoreLayout(num_layers))
    return Place(where.key, where.sizes + tuple(full), where.index + tuple(offset),
                 len(where.index), writer, halves)


def saved_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's parameters, then the buffers its checkpoints hold (``names.is_buffer``:
    the routers' expert biases)."""
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if is_buffer(n))


def chunk_places(chunk: nn.Module, num_layers: int, tp_rank: int,
                 tp_size: int) -> Iterator[tuple[str, nn.Parameter, Place]]:
    """``(name, tensor, place)`` of every parameter of one model chunk (unwrapped) and of
    the buffers it saves; a chunk of a model with experts lays them out by its config, each
    expert at its global number."""
    layers = getattr(getattr(chunk, "encoder", None), "layers", [])
    config = getattr(chunk, "config", None)
    layout = mcore_layout(config) if config is not None else None
    for name, param in saved_tensors(chunk):
        parsed = parse_layer_key(name)
        layer = layers[parsed[0]].layer_number - 1 if parsed else None
        first_expert = getattr(layers[parsed[0]].mlp, "first_expert", 0) if parsed else 0
        yield name, param, place(renumber_expert(name, first_expert), tuple(param.shape),
                                 layer, num_layers, tp_rank, tp_size, tp_parts(name, config),
                                 layout=layout)


def first_replica(param: nn.Parameter, dp_rank: int, expert_parallel_size: int) -> bool:
    """Whether data-parallel rank ``dp_rank`` writes ``param`` (its replicas hold the same):
    rank 0, or for experts shared out by expert parallelism each expert group's first, the
    ``expert_parallel_size`` data-parallel ranks that together hold every expert once."""
    return dp_rank < expert_parallel_size if is_expert(param) else dp_rank == 0


def local_views(place: Place, tensor: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
    """``(global offset, view)`` of a parameter's whole local tensor: one box, or one per
    part (views of ``tensor``: what is read into them lands in it)."""
    out = []
    for offset, _, local, sizes in place.boxes((0,) * tensor.dim(), tuple(tensor.shape)):
        view = tensor.narrow(0, local[0], sizes[0]) if tensor.dim() else tensor
        out.append((offset, place.unsqueezed(view)))
    return out


def whole_model_shapes(config: Any) -> dict[str, torch.Size]:
    """Every parameter of the whole model (tp 1, one stage, our full names) and its shape,
    from a ``ModelConfig``, without memory."""
    whole = dataclasses.replace(config, tensor_model_parallel_size=1, sequence_parallel=False,
                                expert_model_parallel_size=1)
    with assume_tensor_parallel_rank(1, 0):  # whatever this process's groups are
        model = GPTModel(whole, device="meta")
    return {name: p.shape for name, p in saved_tensors(model)}


def local_layers(chunk: nn.Module) -> list[int]:
    """The global (0-based) layer numbers a chunk holds."""
    layers = getattr(getattr(chunk, "encoder", None), "layers", [])
    return [layer.layer_number - 1 for layer in layers]


def full_places(names_and_shapes: dict[str, torch.Size], num_layers: int,
                config: Any = None) -> dict[str, Place]:
    """Places of a whole model's parameters (tp 1, one stage; full names with global layer
    and expert numbers, as ``conversion/`` holds them); ``config``: the ``ModelConfig``
    (needed for experts)."""
    layout = mcore_layout(config) if config is not None else McoreLayout(num_layers)
    out = {}
    for name, shape in names_and_shapes.items():
        parsed = parse_layer_key(name)
        out[name] = place(name, tuple(shape), parsed[0] if parsed else None, num_layers, 0, 1,
                          layout=layout)
    return out


def _shard(index: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """megatron-core's ShardedObject suffix: ``shard_<offsets>_<shape>``, axes joined by
    dots (an unstacked layer's object is the one shard of shape 1)."""
    index, sizes = (index, sizes) if index else ((0,), (1,))
    return f"shard_{'.'.join(map(str, index))}_{'.'.join(map(str, sizes))}"


def extra_state_key(module: str, layer: int, num_layers: int) -> str:
    """megatron-core's name of a (stacked) layer's ``_extra_state`` object."""
    return f"{LAYERS}{module}._extra_state/{_shard((layer,), (num_layers,))}"


def layer_extra_state_keys(layer: int, config: Any) -> list[str]:
    """The ``_extra_state`` objects megatron-core's loader asks for of global layer
    ``layer`` (0-based) of a model of ``config``: its attention's, and its MLP's, or each
    expert's and the shared expert's."""
    if mcore_layout(config).stacked:
        prefix, index, sizes = LAYERS, (layer,), (config.num_layers,)
    else:
        prefix, index, sizes = f"{LAYERS}{layer}.", (), ()
    objects = [(m, index, sizes) for m in ATTENTION_EXTRA_STATE]
    if not config.moe_layers[layer]:
        objects += [(f"mlp.{m}", index, sizes) for m in MLP_EXTRA_STATE]
    else:
        objects += [(EXPERTS + m, index + (e,), sizes + (config.num_experts,))
                    for e in range(config.num_experts) for m in MLP_EXTRA_STATE]
        if config.moe_shared_expert_intermediate_size is not None:
            objects += [(SHARED_EXPERTS + m, index, sizes) for m in MLP_EXTRA_STATE]
    return [f"{prefix}{m}._extra_state/{_shard(i, s)}" for m, i, s in objects]


def rng_key(pp_rank: int, tp_rank: int, pp_size: int, tp_size: int) -> str:
    """Megatron-LM's name of the random-generator states of one (pipeline, tensor) rank."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp_size}.{tp_size}"


def optimizer_key(kind: str, key: str) -> str:
    """The name of optimizer state ``kind`` (exp_avg, exp_avg_sq, param, fp32_param) of the
    parameter stored as ``key``."""
    return f"{OPTIMIZER_PREFIX}{kind}.{key}"

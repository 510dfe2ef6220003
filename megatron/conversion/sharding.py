"""How each tensor of our GPTModel is cut over tensor-parallel ranks and pipeline chunks.

Full (tp 1, one stage) names are ``GPTModel(pre_process=True, post_process=True)``'s:
``embedding.word_embeddings.weight``, ``embedding.position_embeddings.weight``,
``encoder.layers.{i}.<...>`` with the global layer index ``i``, ``final_layernorm.*`` and, with
untied embeddings, ``output_layer.weight``. A pipeline chunk numbers its layers from 0 and, when
it is the last chunk but not the first, holds its own copy of the tied word embeddings as
``word_embeddings.weight``.

Which dimension each tensor is cut along over tensor-parallel ranks (``tp_split_dim``) and
which layers a chunk holds are ``megatron/model/placement.py``'s rules; this module
merges, splits and renames by them.
"""

from __future__ import annotations

import re

import torch

from megatron.model.placement import (  # noqa: F401 - conversion's names
    OUTPUT_LAYER,
    TIED_COPY,
    VOCAB_TENSORS,
    WORD_EMBEDDINGS,
    Chunk,
    pipeline_chunks,
    tp_split_dim,
)

_LAYER_RE = re.compile(r"encoder\.layers\.(\d+)\.(.+)")

def merge_tp(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from each tensor-parallel rank's piece, in rank order."""
    dim = tp_split_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=dim)


def split_tp(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each tensor-parallel rank's piece of ``full`` (clones, so each saves on its own)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return [full.clone() for _ in range(tp)]
    if full.size(dim) % tp:
        raise ValueError(f"{name}: size {full.size(dim)} along dimension {dim} does not split "
                         f"over tensor-parallel size {tp}")
    return [p.clone() for p in torch.chunk(full, tp, dim=dim)]


def tp_piece(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s piece of ``full`` (a clone)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full.clone()
    if full.size(dim) % tp:
        raise ValueError(f"{name}: size {full.size(dim)} along dimension {dim} does not split "
                         f"over tensor-parallel size {tp}")
    return torch.chunk(full, tp, dim=dim)[tp_rank].clone()


def resize_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with ``rows`` rows: padding rows past ``rows`` dropped, zero rows added."""
    if t.size(0) >= rows:
        return t[:rows].clone()
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


# Pipeline ----------------------------------------------------------------------------------


def chunks_from_layer_counts(counts: list[list[int]]) -> list[list[Chunk]]:
    """The chunks of a saved checkpoint from how many layers each (stage, virtual) chunk holds:
    global chunk ``v * pp + p`` follows chunk ``v * pp + p - 1`` (Megatron's interleaving)."""
    pp, vp = len(counts), len(counts[0])
    first, order = 0, {}
    for v in range(vp):
        for p in range(pp):
            order[(p, v)] = first
            first += counts[p][v]
    return [[Chunk(p, v, order[(p, v)], counts[p][v], p == 0 and v == 0,
                   p == pp - 1 and v == vp - 1) for v in range(vp)] for p in range(pp)]


def layer_count(chunk_state: dict) -> int:
    found = {int(m.group(1)) for m in map(_LAYER_RE.fullmatch, chunk_state) if m}
    if found and found != set(range(len(found))):
        raise ValueError(f"chunk layers are numbered {sorted(found)}, expected 0..{len(found) - 1}")
    return len(found)


def chunk_to_full_names(chunk_state: dict, chunk: Chunk) -> dict:
    """A chunk's entries under full names; the tied copy (``word_embeddings.weight``) stays
    under its own name for the caller to check or drop."""
    out = {}
    for name, value in chunk_state.items():
        m = _LAYER_RE.fullmatch(name)
        if m:
            name = f"encoder.layers.{chunk.first_layer + int(m.group(1))}.{m.group(2)}"
        out[name] = value
    return out


def full_to_chunk_names(full: dict, chunk: Chunk, tied: bool) -> dict:
    """The entries of ``full`` (full names) that ``chunk`` holds, under its own names."""
    out = {}
    last = chunk.first_layer + chunk.num_layers
    for name, value in full.items():
        m = _LAYER_RE.fullmatch(name)
        if m:
            i = int(m.group(1))
            if chunk.first_layer <= i < last:
                out[f"encoder.layers.{i - chunk.first_layer}.{m.group(2)}"] = value
        elif name.startswith("embedding."):
            if chunk.pre_process:
                out[name] = value
        elif name.startswith("final_layernorm.") or name == OUTPUT_LAYER:
            if chunk.post_process:
                out[name] = value
    if tied and chunk.post_process and not chunk.pre_process:
        out[TIED_COPY] = full[WORD_EMBEDDINGS]
    return _in_model_order(out)


def _order_key(name: str) -> tuple:
    """Keys in the order GPTModel registers its parameters (its state_dict order)."""
    if name.startswith("embedding.word"):
        return (0, 0, "")
    if name.startswith("embedding."):
        return (0, 1, name)
    m = _LAYER_RE.fullmatch(name)
    if m:
        return (1, int(m.group(1)), _LAYER_PARAM_ORDER.index(m.group(2)))
    return (2, ("final_layernorm.weight", "final_layernorm.bias", OUTPUT_LAYER, TIED_COPY)
            .index(name), "")


_LAYER_PARAM_ORDER = [
    f"{module}.{kind}" for module in (
        "input_layernorm", "self_attention.query_key_value", "self_attention.dense",
        "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
    for kind in ("weight", "bias")
]


def _in_model_order(state: dict) -> dict:
    return {k: state[k] for k in sorted(state, key=_order_key)}

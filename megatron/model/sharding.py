"""How each tensor of our GPTModel is cut over tensor-parallel ranks and pipeline chunks.

Full (tp 1, one stage) names are ``GPTModel(pre_process=True, post_process=True)``'s:
``embedding.word_embeddings.weight``, ``embedding.position_embeddings.weight``,
``encoder.layers.{i}.<...>`` with the global layer index ``i``, ``final_layernorm.*`` and, with
untied embeddings, ``output_layer.weight``. A pipeline chunk numbers its layers from 0 and, when
it is the last chunk but not the first, holds its own copy of the tied word embeddings as
``word_embeddings.weight``.

Which dimension each tensor is cut along over tensor-parallel ranks (``tp_split_dim``) is
``megatron/model/names.py``'s rule and which layers a chunk holds
``megatron/model/placement.py``'s; this module merges, splits and renames by them.
"""

from __future__ import annotations

import torch

from megatron.model.names import (
    OUTPUT_LAYER,
    TIED_COPY,
    WORD_EMBEDDINGS,
    model_order_key,
    parse_layer_key,
    renumber_layer,
    tp_split_dim,
)
from megatron.model.placement import Chunk


def merge_tp(name: str, pieces: list[torch.Tensor], parts: int = 1) -> torch.Tensor:
    """The full tensor from each tensor-parallel rank's piece, in rank order. ``parts``
    (``names.tp_parts``): each piece is that many parts one after another, each the rank's
    share of its own part of the full tensor (SwiGLU's ``[gate_r; up_r]``)."""
    dim = tp_split_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if parts == 1:
        return torch.cat(pieces, dim=dim)
    shares = [torch.chunk(p, parts, dim=dim) for p in pieces]
    return torch.cat([torch.cat([s[i] for s in shares], dim=dim) for i in range(parts)],
                     dim=dim)


def split_tp(name: str, full: torch.Tensor, tp: int, parts: int = 1) -> list[torch.Tensor]:
    """Each tensor-parallel rank's piece of ``full`` (clones, so each saves on its own);
    ``parts`` as for ``merge_tp``."""
    return [tp_piece(name, full, tp, r, parts) for r in range(tp)]


def tp_piece(name: str, full: torch.Tensor, tp: int, tp_rank: int,
             parts: int = 1) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s piece of ``full`` (a clone); ``parts`` as for
    ``merge_tp``."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full.clone()
    if full.size(dim) % (tp * parts):
        raise ValueError(f"{name}: size {full.size(dim)} along dimension {dim} does not split "
                         f"over tensor-parallel size {tp}")
    shares = [torch.chunk(part, tp, dim=dim)[tp_rank] for part in torch.chunk(full, parts, dim)]
    return torch.cat(shares, dim=dim).clone() if parts > 1 else shares[0].clone()


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
    found = {parsed[0] for parsed in map(parse_layer_key, chunk_state) if parsed}
    if found and found != set(range(len(found))):
        raise ValueError(f"chunk layers are numbered {sorted(found)}, expected 0..{len(found) - 1}")
    return len(found)


def chunk_to_full_names(chunk_state: dict, chunk: Chunk) -> dict:
    """A chunk's entries under full names; the tied copy (``word_embeddings.weight``) stays
    under its own name for the caller to check or drop."""
    return {renumber_layer(name, chunk.first_layer): value
            for name, value in chunk_state.items()}


def full_to_chunk_names(full: dict, chunk: Chunk, tied: bool) -> dict:
    """The entries of ``full`` (full names) that ``chunk`` holds, under its own names."""
    out = {}
    last = chunk.first_layer + chunk.num_layers
    for name, value in full.items():
        parsed = parse_layer_key(name)
        if parsed:
            if chunk.first_layer <= parsed[0] < last:
                out[renumber_layer(name, -chunk.first_layer)] = value
        elif name.startswith("embedding."):
            if chunk.pre_process:
                out[name] = value
        elif name.startswith("final_layernorm.") or name == OUTPUT_LAYER:
            if chunk.post_process:
                out[name] = value
    if tied and chunk.post_process and not chunk.pre_process:
        out[TIED_COPY] = full[WORD_EMBEDDINGS]
    return _in_model_order(out)


def _in_model_order(state: dict) -> dict:
    return {k: state[k] for k in sorted(state, key=model_order_key)}

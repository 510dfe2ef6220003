"""megatron-core's router bias, which our mixture-of-experts router does not have.

megatron-core (0.16) gives each MoE layer's router a bias ``mlp.router.bias`` [E] under
``--add-bias-linear`` (its default), and its loader asks for it. Ours routes without one,
which is a zero bias: a save of a model with biases writes zeros there (so megatron-core
loads it and computes our logits), and a read checks that the stored biases are zero (ours,
or Megatron-LM's set to zero) and refuses, by name, a model whose routers learnt biases.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.torch_dist import dcp
from megatron.model.mcore_names import LAYERS, ROUTER_BIAS, mcore_layout

_KEY = re.compile(re.escape(LAYERS) + r"(?:\d+\.)?" + re.escape(ROUTER_BIAS))


def zero_bias_pieces(config: Any, layers: list[int]) -> list[dcp.Piece]:
    """The zero router biases of the global ``layers`` (0-based) a rank writes, for a model
    of ``config`` (a ``ModelConfig``); none without experts or biases."""
    if not config.num_experts or not config.add_bias_linear:
        return []
    layout, experts = mcore_layout(config), config.num_experts
    pieces = []
    for layer in (i for i in layers if config.moe_layers[i]):
        if layout.stacked:
            pieces.append(dcp.Piece(LAYERS + ROUTER_BIAS, (config.num_layers, experts),
                                    (layer, 0), torch.zeros(1, experts)))
        else:
            pieces.append(dcp.Piece(f"{LAYERS}{layer}.{ROUTER_BIAS}", (experts,), (0,),
                                    torch.zeros(experts)))
    return pieces


def stored_bias_pieces(metadata: Any) -> list[dcp.Piece]:
    """Every router bias the checkpoint stores, whole (to check after the read)."""
    return [dcp.Piece(key, tuple(md.size), (0,) * len(md.size), torch.zeros(tuple(md.size)))
            for key, md in metadata.state_dict_metadata.items() if _KEY.fullmatch(key)]


def refuse_learnt_biases(pieces: list[dcp.Piece], where: str) -> None:
    """Raise ``CheckpointError`` if a router bias read (``stored_bias_pieces``) is not
    zero. Every rank reads them all, so every rank decides the same."""
    for piece in pieces:
        if piece.tensor.count_nonzero():
            raise CheckpointError(
                f"checkpoint {where}: its mixture-of-experts routers have biases "
                f"({piece.key}, megatron-core's under --add-bias-linear), which this "
                "framework's router does not have; train it with --disable-bias-linear, or "
                "with its router biases fixed at zero, to read it here")

"""Multi-level (V-cycle) training operators: coalesce, de-coalesce, interpolate.

From "A Multi-Level Framework for Accelerating Training Transformer Models" (Zou, Zhang and
Deng, ICLR 2024, arXiv 2404.07999) and the operators its authors published for HF GPT-2,
restated for our ``GPTModel`` state dict (tensor and pipeline size 1, our key names).

Width. Each of three spaces is split into pairs of neighbours: the hidden (residual) channels,
the attention heads (whole heads of ``kv_channels`` each, so the head size is kept and the head
count halves) and the MLP channels. Write ``a, b`` for the two members of a pair.

- *coalesce* (``F``): an output row of a pair is the mean of the two rows, ``(W[a] + W[b]) / 2``
  (the same for biases and LayerNorm weights); an input column is the sum of the two columns,
  ``W[:, a] + W[:, b]``, since the small neuron stands for both inputs. The word and position
  embeddings (and an untied output layer, the transpose of an input) are summed over each pair
  of hidden channels, as the authors' ``wte * 2`` after averaging does.
- *de-coalesce* (``T``, the paper's normalised transpose of ``F``): an output row is copied to
  both members, an input column is split in halves, ``W[:, a] = W[:, b] = W / 2``; embeddings
  are halved into both members.

Depth: layers ``2i`` and ``2i + 1`` coalesce into small layer ``i`` (the mean of their
parameters, the paper's ``R``); de-coalescing copies small layer ``i`` to both (``G``).

So ``coalesce(decoalesce(small)) == small`` exactly, and a large model whose pairs of neurons
and layers are equal is unchanged by a coalesce / de-coalesce round trip.

*interpolate*: ``(1 - alpha) * large + alpha * decoalesced`` parameter by parameter; alpha
breaks the symmetry de-coalescing makes between the members of each pair.

Pairing: ``adjacent`` pairs neighbours ``(2i, 2i + 1)`` (channels, heads, MLP channels), as the
paper describes; ``halves`` pairs ``i`` with ``i + n/2``, the default of the authors' published
code. Optimizer state does not survive any of these operators (the tools reset it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron.config import ModelConfig
from megatron.model.names import (
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    TIED_COPY,
    WORD_EMBEDDINGS,
    layer_key,
    parse_layer_key,
)

PAIRINGS = ("adjacent", "halves")
StateDict = dict[str, torch.Tensor]



class MultilevelError(ValueError):
    """A model or state dict these operators cannot map; the message says why."""


# ---------------------------------------------------------------------------------------------
# Pairs along one dimension.


def pair_index(n: int, pairing: str, chunk: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(a, b)``, each of length ``n / 2``: element ``a[k]`` pairs with ``b[k]``.

    ``chunk`` > 1 pairs whole chunks (attention heads of ``chunk`` channels): with ``adjacent``,
    chunk ``2j`` with ``2j + 1``; with ``halves``, chunk ``j`` with ``j + n/(2 chunk)``.
    """
    if pairing not in PAIRINGS:
        raise MultilevelError(f"pairing {pairing!r} is not one of {', '.join(PAIRINGS)}")
    if n % (2 * chunk):
        raise MultilevelError(f"a dimension of {n} cannot be split into pairs of {chunk}")
    chunks = torch.arange(n).view(n // chunk, chunk)  # [n/c, c]
    if pairing == "adjacent":
        first, second = chunks[0::2], chunks[1::2]
    else:
        half = n // chunk // 2
        first, second = chunks[:half], chunks[half:]
    return first.reshape(-1), second.reshape(-1)


def _merge(t: torch.Tensor, dim: int, pairs, mean: bool) -> torch.Tensor:
    a, b = pairs
    out = t.index_select(dim, a) + t.index_select(dim, b)
    return out / 2 if mean else out


def _split(t: torch.Tensor, dim: int, pairs, halve: bool) -> torch.Tensor:
    a, b = pairs
    shape = list(t.shape)
    shape[dim] *= 2
    out = t.new_empty(shape)
    part = t / 2 if halve else t
    out.index_copy_(dim, a, part)
    out.index_copy_(dim, b, part)
    return out


# ---------------------------------------------------------------------------------------------
# Width.


class _WidthMaps:
    """The pairs of the three spaces of a large model's config."""

    def __init__(self, config: ModelConfig, pairing: str) -> None:
        self.hidden = pair_index(config.hidden_size, pairing)
        self.heads = pair_index(config.num_attention_heads, pairing)
        self.ffn = pair_index(config.ffn_hidden_size, pairing)
        self.kv_channels = config.kv_channels


def _width_layer_param(name: str, t: torch.Tensor, maps: _WidthMaps, out_op, in_op):
    """One layer parameter mapped with ``out_op`` on its output dim and ``in_op`` on its input.

    ``out_op(t, dim, pairs)`` / ``in_op(t, dim, pairs)`` are the coalesce (mean / sum) or the
    de-coalesce (copy / halves) of one dimension.
    """
    d = maps.kv_channels
    if name.endswith("layernorm.weight") or name.endswith("layernorm.bias"):
        return out_op(t, 0, maps.hidden)
    if name.startswith("self_attention.query_key_value."):
        rows = t.reshape(-1, 3 * d, *t.shape[1:])  # [n, 3d, (h)]: whole heads
        rows = out_op(rows, 0, maps.heads)
        rows = rows.reshape(-1, *t.shape[1:])
        return in_op(rows, 1, maps.hidden) if t.ndim == 2 else rows
    if name == "self_attention.dense.weight":
        w = out_op(t, 0, maps.hidden)  # [h', n*d]
        w = in_op(w.reshape(w.shape[0], -1, d), 1, maps.heads)  # [h', n', d]
        return w.reshape(w.shape[0], -1)
    if name in ("self_attention.dense.bias", "mlp.dense_4h_to_h.bias"):
        return out_op(t, 0, maps.hidden)
    if name == "mlp.dense_h_to_4h.weight":
        return in_op(out_op(t, 0, maps.ffn), 1, maps.hidden)
    if name == "mlp.dense_h_to_4h.bias":
        return out_op(t, 0, maps.ffn)
    if name == "mlp.dense_4h_to_h.weight":
        return in_op(out_op(t, 0, maps.hidden), 1, maps.ffn)
    raise MultilevelError(f"no width map for layer parameter {name!r}")


_EMBEDDINGS = (WORD_EMBEDDINGS, POSITION_EMBEDDINGS, OUTPUT_LAYER, TIED_COPY)


def _map_width(state: Mapping[str, torch.Tensor], maps: _WidthMaps, out_op, in_op) -> StateDict:
    out = {}
    for key, t in state.items():
        parsed = parse_layer_key(key)
        if parsed:
            out[key] = _width_layer_param(parsed[1], t, maps, out_op, in_op)
        elif key in _EMBEDDINGS:
            out[key] = in_op(t, 1, maps.hidden)  # [rows, h]: hidden is the input side
        elif key.startswith("final_layernorm."):
            out[key] = out_op(t, 0, maps.hidden)
        else:
            raise MultilevelError(f"no width map for parameter {key!r}")
    return out


def _mean(t, dim, pairs):
    return _merge(t, dim, pairs, mean=True)


def _sum(t, dim, pairs):
    return _merge(t, dim, pairs, mean=False)


def _copy(t, dim, pairs):
    return _split(t, dim, pairs, halve=False)


def _halves(t, dim, pairs):
    return _split(t, dim, pairs, halve=True)


# ---------------------------------------------------------------------------------------------
# Depth.


def _layer_params(state: Mapping[str, torch.Tensor]) -> tuple[dict[int, dict], StateDict]:
    """(layer index -> {name in layer: tensor}, the parameters outside the layers)."""
    layers: dict[int, dict] = {}
    rest = {}
    for key, t in state.items():
        parsed = parse_layer_key(key)
        if parsed:
            layers.setdefault(parsed[0], {})[parsed[1]] = t
        else:
            rest[key] = t
    return layers, rest


def _coalesce_depth(state: Mapping[str, torch.Tensor], num_layers: int) -> StateDict:
    layers, out = _layer_params(state)
    for i in range(num_layers // 2):
        for name, t in layers[2 * i].items():
            out[layer_key(i, name)] = (t + layers[2 * i + 1][name]) / 2
    return out


def _decoalesce_depth(state: Mapping[str, torch.Tensor], num_layers: int) -> StateDict:
    layers, out = _layer_params(state)
    for i in range(num_layers):
        for name, t in layers[i].items():
            out[layer_key(2 * i, name)] = t.clone()
            out[layer_key(2 * i + 1, name)] = t.clone()
    return out


# ---------------------------------------------------------------------------------------------
# Public operators.


def _check_state(state: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    if config.tensor_model_parallel_size != 1:
        raise MultilevelError("the operators map a full model (tensor-model-parallel size 1); "
                              f"this config has {config.tensor_model_parallel_size}")
    layers, _ = _layer_params(state)
    if sorted(layers) != list(range(config.num_layers)):
        raise MultilevelError(f"the state dict has layers {sorted(layers)}, the config "
                              f"{config.num_layers}: pass a full (pipeline size 1) model")


def _require_even(config: ModelConfig, width: bool, depth: bool) -> None:
    need = []
    if depth:
        need.append(("--num-layers", config.num_layers))
    if width:
        need += [("--hidden-size", config.hidden_size),
                 ("--num-attention-heads", config.num_attention_heads),
                 ("--ffn-hidden-size", config.ffn_hidden_size)]
    odd = [f"{flag} {value}" for flag, value in need if value % 2]
    if odd:
        raise MultilevelError(f"cannot halve an odd size: {', '.join(odd)}")


def coalesced_config(config: ModelConfig, *, width: bool = True,
                     depth: bool = True) -> ModelConfig:
    """The config of the coalesced (small) model: sizes halved, head size kept."""
    _require_even(config, width, depth)
    changes = {"kv_channels": config.kv_channels}
    if depth:
        changes["num_layers"] = config.num_layers // 2
    if width:
        changes.update(hidden_size=config.hidden_size // 2,
                       num_attention_heads=config.num_attention_heads // 2,
                       ffn_hidden_size=config.ffn_hidden_size // 2)
    return config.replace(**changes)


def decoalesced_config(config: ModelConfig, *, width: bool = True,
                       depth: bool = True) -> ModelConfig:
    """The config of the de-coalesced (large) model: sizes doubled, head size kept."""
    changes = {"kv_channels": config.kv_channels}
    if depth:
        changes["num_layers"] = config.num_layers * 2
    if width:
        changes.update(hidden_size=config.hidden_size * 2,
                       num_attention_heads=config.num_attention_heads * 2,
                       ffn_hidden_size=config.ffn_hidden_size * 2)
    return config.replace(**changes)


def coalesce(state: Mapping[str, torch.Tensor], config: ModelConfig, *, width: bool = True,
             depth: bool = True, pairing: str = "adjacent") -> tuple[StateDict, ModelConfig]:
    """The small model (state dict, config) coalesced from the large ``state``/``config``."""
    _check_state(state, config)
    small = coalesced_config(config, width=width, depth=depth)
    out = dict(state)
    if width:
        out = _map_width(out, _WidthMaps(config, pairing), _mean, _sum)
    if depth:
        out = _coalesce_depth(out, config.num_layers)
    return _contiguous(out), small


def decoalesce(state: Mapping[str, torch.Tensor], config: ModelConfig, *, width: bool = True,
               depth: bool = True, pairing: str = "adjacent") -> tuple[StateDict, ModelConfig]:
    """The large model (state dict, config) de-coalesced from the small ``state``/``config``."""
    _check_state(state, config)
    large = decoalesced_config(config, width=width, depth=depth)
    out = dict(state)
    if width:
        out = _map_width(out, _WidthMaps(large, pairing), _copy, _halves)
    if depth:
        out = _decoalesce_depth(out, config.num_layers)
    return _contiguous(out), large


def interpolate(large: Mapping[str, torch.Tensor], decoalesced: Mapping[str, torch.Tensor],
                alpha: float) -> StateDict:
    """``(1 - alpha) * large + alpha * decoalesced`` for every parameter (same keys, shapes).

    alpha 0 returns ``large`` and alpha 1 ``decoalesced``, exactly (copies of them).
    """
    if not 0.0 <= alpha <= 1.0:
        raise MultilevelError(f"--alpha must be in [0, 1], got {alpha}")
    if set(large) != set(decoalesced):
        missing = sorted(set(large) ^ set(decoalesced))[:5]
        raise MultilevelError(f"the two models have different parameters (e.g. {missing})")
    out = {}
    for key, t in large.items():
        other = decoalesced[key]
        if t.shape != other.shape:
            raise MultilevelError(f"{key}: shapes {tuple(t.shape)} and {tuple(other.shape)} "
                                  "differ: interpolate a large model with its de-coalesced "
                                  "small model")
        out[key] = _blend(t, other, alpha)
    return out


def _blend(large: torch.Tensor, small: torch.Tensor, alpha: float) -> torch.Tensor:
    if alpha == 0.0:
        return large.clone()
    if alpha == 1.0:
        return small.clone()
    return (1 - alpha) * large + alpha * small


def _contiguous(state: StateDict) -> StateDict:
    return {k: v.contiguous() for k, v in state.items()}


"""megatron-core's names of our GPT parameters (Megatron-LM's ``torch_dist`` checkpoints):
the layers' parameters stacked along a leading axis of size ``--num-layers`` under
``decoder.layers.<name>``, the layer norms under the names of the linear layer they feed
(Transformer Engine fuses them). ``MCORE`` is the ``adapters.StateDictAdapter`` of a whole
model; ``checkpointing/formats/torch_dist/mcore_layout.py`` places each rank's pieces in
those global tensors."""

from __future__ import annotations

from typing import Any

import torch

from megatron.model.names import (
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    TIED_COPY,
    WORD_EMBEDDINGS,
    layer_key,
    parse_layer_key,
    refuse_experts,
)

LAYERS = "decoder.layers."
# Our per-layer parameter names (after "encoder.layers.{i}.") -> megatron-core's.
_LAYER_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
_OTHER_NAMES = {
    WORD_EMBEDDINGS: WORD_EMBEDDINGS,
    TIED_COPY: WORD_EMBEDDINGS,  # the last stage's copy of tied embeddings: the same tensor
    POSITION_EMBEDDINGS: POSITION_EMBEDDINGS,
    "final_layernorm.weight": "decoder.final_layernorm.weight",
    "final_layernorm.bias": "decoder.final_layernorm.bias",
    OUTPUT_LAYER: OUTPUT_LAYER,
}
_LAYER_NAMES_BACK = {theirs: ours for ours, theirs in _LAYER_NAMES.items()}
_OTHER_NAMES_BACK = {theirs: ours for ours, theirs in _OTHER_NAMES.items() if ours != TIED_COPY}


def mcore_name(name: str) -> tuple[str, bool]:
    """megatron-core's global tensor name of our parameter ``name`` (chunk or full name), and
    whether it is a layer's (stacked over the layers); KeyError for a name it has none of."""
    parsed = parse_layer_key(name)
    if parsed and parsed[1] in _LAYER_NAMES:
        return LAYERS + _LAYER_NAMES[parsed[1]], True
    if name not in _OTHER_NAMES:
        raise KeyError(f"no megatron-core name for parameter {name!r}")
    return _OTHER_NAMES[name], False


class McoreAdapter:
    """``adapters.StateDictAdapter`` of megatron-core's whole-model tensors (layers stacked)."""

    name = "mcore"

    def to_ours(self, state: dict, config: Any) -> dict:
        refuse_experts(config, "megatron-core's torch_dist names")
        out = {}
        for key, tensor in state.items():
            if key.startswith(LAYERS):
                ours = _LAYER_NAMES_BACK[key[len(LAYERS):]]
                out.update({layer_key(i, ours): t.clone() for i, t in enumerate(tensor)})
            elif key in _OTHER_NAMES_BACK:
                out[_OTHER_NAMES_BACK[key]] = tensor
            else:
                raise KeyError(f"unknown megatron-core tensor {key!r}")
        return out

    def from_ours(self, state: dict, config: Any) -> dict:
        refuse_experts(config, "megatron-core's torch_dist names")
        out, layers = {}, {}
        for name, tensor in state.items():
            key, stacked = mcore_name(name)
            if stacked:
                layers.setdefault(key, {})[parse_layer_key(name)[0]] = tensor
            elif name != TIED_COPY:
                out[key] = tensor
        for key, per_layer in layers.items():
            out[key] = torch.stack([per_layer[i] for i in sorted(per_layer)])
        return out


MCORE = McoreAdapter()

"""megatron-core's names of our GPT parameters (Megatron-LM's ``torch_dist`` checkpoints):
the layers' parameters stacked along a leading axis of size ``--num-layers`` under
``decoder.layers.<name>``, the layer norms under the names of the linear layer they feed
(Transformer Engine fuses them; the local spec maps its own names so too).

Mixture-of-experts layers (megatron-core's MoELayer with SequentialMLP experts) keep the
router (``mlp.router.weight`` [E, h], ``mlp.router.expert_bias`` [E] under
--moe-router-enable-expert-bias; and ``mlp.router.bias`` [E] under --add-bias-linear, which
ours lacks: ``ROUTER_BIAS``), the shared expert (``mlp.shared_experts.linear_fc1.weight``,
..., ``gate_weight``) and one global tensor per expert linear layer with an expert axis after
the layer axis (``mlp.experts.experts.linear_fc1.weight`` [L, E, f, h]); their pre-MLP norm
is ``mlp.linear_fc1.layer_norm_weight`` as in dense layers. When the layers differ (experts
in some only: ``--moe-layer-freq`` other than 1, megatron-core's ``non_homogeneous_layers``)
nothing is stacked: each layer's tensors are ``decoder.layers.<i>.<name>`` and the experts'
``[E, f, h]``. ``mcore_tensor`` names where one of ours sits; ``MCORE`` is the
``adapters.StateDictAdapter`` of a whole model; ``checkpointing/formats/torch_dist/
mcore_layout.py`` places each rank's pieces in those global tensors."""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Optional

from megatron.model.names import (
    EXPERT_BIAS,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    ROUTER,
    SHARED_EXPERT_GATE,
    TIED_COPY,
    WORD_EMBEDDINGS,
    chunk_names,
    parse_layer_key,
)

LAYERS = "decoder.layers."
EXPERTS = "mlp.experts.experts."  # SequentialMLP's global tensors (its ``experts.`` prefix twice)
SHARED_EXPERTS = "mlp.shared_experts."
# megatron-core's router has a bias [E] under --add-bias-linear; ours has none (a zero one:
# checkpointing/formats/torch_dist/mcore_router.py writes and checks it).
ROUTER_BIAS = "mlp.router.bias"
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
    ROUTER: ROUTER,
    EXPERT_BIAS: EXPERT_BIAS,  # fp32 buffer (loss-free balancing), megatron-core's too
    SHARED_EXPERT_GATE: SHARED_EXPERT_GATE,
}
_OTHER_NAMES = {
    WORD_EMBEDDINGS: WORD_EMBEDDINGS,
    TIED_COPY: WORD_EMBEDDINGS,  # the last stage's copy of tied embeddings: the same tensor
    POSITION_EMBEDDINGS: POSITION_EMBEDDINGS,
    "final_layernorm.weight": "decoder.final_layernorm.weight",
    "final_layernorm.bias": "decoder.final_layernorm.bias",
    OUTPUT_LAYER: OUTPUT_LAYER,
}
_EXPERT = re.compile(r"mlp\.local_experts\.(\d+)\.(dense_\w+\.\w+)")
_SHARED = re.compile(r"mlp\.shared_experts\.(dense_\w+\.\w+)")


class McoreLayout(NamedTuple):
    """How megatron-core lays out a model's tensors: ``num_layers`` along the leading axis
    when ``stacked``, else one name per layer; ``num_experts`` along the experts' axis."""

    num_layers: int
    num_experts: int = 0
    stacked: bool = True


def stacks_layers(moe_layer_freq: Any) -> bool:
    """Whether megatron-core stacks the layers: not when ``--moe-layer-freq`` makes them
    differ (a number above 1, or any list: its TransformerBlock's rule)."""
    text = str(moe_layer_freq if moe_layer_freq is not None else 1).replace(" ", "")
    return text.isdigit() and int(text) == 1


def mcore_layout(config: Any) -> McoreLayout:
    """The layout of a model of ``config`` (a ``ModelConfig``)."""
    return McoreLayout(config.num_layers, config.num_experts or 0,
                       stacks_layers(getattr(config, "moe_layer_freq", 1)))


class McoreTensor(NamedTuple):
    """Where one of our tensors sits: the global tensor ``key`` and, along its leading axes
    of ``sizes`` (the layer's when stacked, then the expert's), at ``index``; our tensor is
    the rest of the global tensor's axes."""

    key: str
    index: tuple[int, ...]
    sizes: tuple[int, ...]


def _inner_name(name: str) -> tuple[str, Optional[int]]:
    """megatron-core's name of a layer's tensor ``name`` (inside the layer, global expert
    numbers) and its expert, if one."""
    expert = _EXPERT.fullmatch(name)
    if expert:
        return EXPERTS + _LAYER_NAMES[f"mlp.{expert[2]}"][len("mlp."):], int(expert[1])
    shared = _SHARED.fullmatch(name)
    if shared:
        return SHARED_EXPERTS + _LAYER_NAMES[f"mlp.{shared[1]}"][len("mlp."):], None
    return _LAYER_NAMES[name], None


def mcore_tensor(name: str, layout: McoreLayout) -> McoreTensor:
    """Where our parameter ``name`` (a whole model's: global layer and expert numbers)
    sits in megatron-core's checkpoint; KeyError for a name it has none of."""
    parsed = parse_layer_key(name)
    if parsed is None:
        if name not in _OTHER_NAMES:
            raise KeyError(f"no megatron-core name for parameter {name!r}")
        return McoreTensor(_OTHER_NAMES[name], (), ())
    layer, inner = parsed
    try:
        key, expert = _inner_name(inner)
    except KeyError:
        raise KeyError(f"no megatron-core name for parameter {name!r}") from None
    index, sizes = ((layer,), (layout.num_layers,)) if layout.stacked else ((), ())
    if expert is not None:
        index, sizes = index + (expert,), sizes + (layout.num_experts,)
    prefix = LAYERS if layout.stacked else f"{LAYERS}{layer}."
    return McoreTensor(prefix + key, index, sizes)


class McoreAdapter:
    """``adapters.StateDictAdapter`` of megatron-core's whole-model tensors (layers stacked,
    experts along their axis)."""

    name = "mcore"

    def to_ours(self, state: dict, config: Any) -> dict:
        layout, out, used = mcore_layout(config), {}, set()
        for name in chunk_names(config, config.num_layers, True, True):
            where = mcore_tensor(name, layout)
            if where.key not in state:
                raise KeyError(f"megatron-core's state has no tensor {where.key!r} ({name})")
            out[name] = state[where.key][where.index].clone()
            used.add(where.key)
        unknown = sorted(set(state) - used)
        if unknown:
            raise KeyError(f"unknown megatron-core tensor {unknown[0]!r}")
        return out

    def from_ours(self, state: dict, config: Any) -> dict:
        layout, out = mcore_layout(config), {}
        for name, tensor in state.items():
            if name == TIED_COPY:
                continue
            where = mcore_tensor(name, layout)
            if where.key not in out:
                # Layers that lack a tensor (a dense layer's experts) stay zero, unwritten.
                out[where.key] = tensor.new_zeros(where.sizes + tuple(tensor.shape))
            out[where.key][where.index] = tensor
        return out


MCORE = McoreAdapter()

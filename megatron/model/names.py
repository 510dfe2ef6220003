"""GPT's parameter names: the one owner of how our state dicts name tensors, in which order a
model registers them, and how each is cut over tensor-parallel ranks.

A model chunk (``GPTModel``) names its tensors::

    embedding.word_embeddings.weight           [V/tp, h]   first chunk (pre_process)
    embedding.position_embeddings.weight       [P, h]      first chunk, learned positions only
    encoder.layers.{i}.<layer parameter>                   i counted from the chunk's first layer
    final_layernorm.weight, .bias              [h]         last chunk (post_process)
    output_layer.weight                        [V/tp, h]   last chunk, untied embeddings
    word_embeddings.weight                     [V/tp, h]   last chunk of a tied model that is
                                                           not also the first: its copy

A whole model (tp 1, one chunk) uses the same names with global layer numbers. Each layer's
parameters, in registration order, with the dimension each is split along over the
tensor-parallel ranks (``LAYER_PARAMS``; QKV and ``dense_h_to_4h`` are column-parallel,
``dense`` and ``dense_4h_to_h`` row-parallel with a replicated bias, layer norms
replicated); ``--disable-bias-linear`` drops the linear layers' biases (``--add-qkv-bias``
keeps the QKV's), RMSNorm has no bias. Under ``--swiglu`` the ``dense_h_to_4h`` rows are
two parts, gate then up, each cut over the ranks on its own (``tp_parts``: a rank holds
``[gate_r; up_r]``). The word embeddings, their copy and the output layer are split over
the (padded) vocabulary.

Names of other programs (Hugging Face, megatron-core, Megatron-DeepSpeed) are their
adapters' business (``adapters.py``: to ours, from ours); they build and parse ours through
this module.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from megatron.config import ModelConfig

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
TIED_COPY = "word_embeddings.weight"  # the last stage's copy of the tied word embeddings
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = ("final_layernorm.weight", "final_layernorm.bias")
VOCAB_TENSORS = (WORD_EMBEDDINGS, TIED_COPY, OUTPUT_LAYER)
LAYER_PREFIX = "encoder.layers."


class LayerParam(NamedTuple):
    """One parameter of a transformer layer: its name inside the layer, the dimension it is
    split along over tensor-parallel ranks (None: replicated), and whose bias it is, if one
    (``norm``: LayerNorm's, none under RMSNorm; ``qkv``: the QKV's, kept by --add-qkv-bias;
    ``linear``: another linear layer's; both gone under --disable-bias-linear)."""

    name: str
    tp_dim: Optional[int]
    bias_of: Optional[str] = None


LAYER_PARAMS = (
    LayerParam("input_layernorm.weight", None),
    LayerParam("input_layernorm.bias", None, "norm"),
    LayerParam("self_attention.query_key_value.weight", 0),
    LayerParam("self_attention.query_key_value.bias", 0, "qkv"),
    LayerParam("self_attention.dense.weight", 1),
    LayerParam("self_attention.dense.bias", None, "linear"),
    LayerParam("post_attention_layernorm.weight", None),
    LayerParam("post_attention_layernorm.bias", None, "norm"),
    LayerParam("mlp.dense_h_to_4h.weight", 0),
    LayerParam("mlp.dense_h_to_4h.bias", 0, "linear"),
    LayerParam("mlp.dense_4h_to_h.weight", 1),
    LayerParam("mlp.dense_4h_to_h.bias", None, "linear"),
)
SWIGLU_PARTS = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")  # [gate; up]
ROUTER = "mlp.router.weight"  # [E, h], replicated
SHARED_EXPERT_GATE = "mlp.shared_experts.gate_weight"  # [1, h], replicated
EXPERT_BIAS = "mlp.router.expert_bias"  # [E] fp32 buffer, replicated (loss-free balancing)
_EXPERT_KEY = re.compile(r"mlp\.(?:local_experts\.(\d+)|shared_experts)\.(dense_\w+\.\w+)")
_EXPERT_NUMBER = re.compile(r"(.*\bmlp\.local_experts\.)(\d+)(\..+)")
_TP_DIMS = {p.name: p.tp_dim for p in LAYER_PARAMS}
_LAYER_ORDER = {p.name: i for i, p in enumerate(LAYER_PARAMS)}
_LAYER_KEY = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.(.+)")


def is_buffer(key: str) -> bool:
    """Whether a model state-dict entry is a buffer (saved, but no parameter: no optimizer
    state, no gradient): the routers' expert biases."""
    parsed = parse_layer_key(key)
    return parsed is not None and parsed[1] == EXPERT_BIAS


def as_dense_mlp_name(name: str) -> str:
    """A mixture-of-experts layer's expert tensor under the dense MLP's name (each expert is
    cut over tensor ranks as the MLP is): ``mlp.local_experts.3.dense_4h_to_h.weight`` ->
    ``mlp.dense_4h_to_h.weight``; other names unchanged."""
    m = _EXPERT_KEY.fullmatch(name)
    return f"mlp.{m.group(2)}" if m else name


def expert_params(config: ModelConfig) -> tuple[str, ...]:
    """A mixture-of-experts layer's MLP tensors, in model order: the router (and its expert
    bias), each expert's
    (as the dense MLP's), then the shared expert's (its gate first, if gated)."""
    dense = [p.name for p in layer_params(config) if p.name.startswith("mlp.")]
    names = [ROUTER, EXPERT_BIAS] if config.moe_router_enable_expert_bias else [ROUTER]
    for j in range(config.num_experts):
        names += [n.replace("mlp.", f"mlp.local_experts.{j}.", 1) for n in dense]
    if config.moe_shared_expert_intermediate_size is not None:
        if config.moe_shared_expert_gate:
            names.append(SHARED_EXPERT_GATE)
        names += [n.replace("mlp.", "mlp.shared_experts.", 1) for n in dense]
    return tuple(names)


def refuse_experts(config, layout: str) -> None:
    """Refuse, by name, a mixture-of-experts model in an outside layout that has no names for
    its experts here yet (``config`` may be any object with ``num_experts``, or None)."""
    experts = getattr(config, "num_experts", None)
    if experts is not None:
        raise ValueError(f"--num-experts ({experts}): mixture-of-experts weights cannot be "
                         f"converted to or from {layout} yet (--ckpt-format torch saves and "
                         "loads them)")


def _has(config: ModelConfig, bias_of: Optional[str]) -> bool:
    if bias_of == "norm":
        return config.normalization != "RMSNorm"
    if bias_of == "qkv":
        return config.add_bias_linear or config.add_qkv_bias
    return bias_of is None or config.add_bias_linear


def layer_params(config: Optional[ModelConfig] = None) -> tuple[LayerParam, ...]:
    """A layer's parameters for ``config`` (all of them without one), in model order."""
    if config is None:
        return LAYER_PARAMS
    return tuple(p for p in LAYER_PARAMS if _has(config, p.bias_of))


def final_norm_names(config: Optional[ModelConfig] = None) -> tuple[str, ...]:
    """The final norm's parameters (RMSNorm's weight alone)."""
    if config is not None and config.normalization == "RMSNorm":
        return FINAL_NORM[:1]
    return FINAL_NORM


def tp_parts(name: str, config: Optional[ModelConfig]) -> int:
    """How many parts tensor ``name`` is, each cut over the tensor-parallel ranks on its own
    (a rank holds its share of each, one after another): 2 for SwiGLU's first projection."""
    parsed = parse_layer_key(name)
    swiglu = config is not None and config.swiglu
    return 2 if swiglu and parsed is not None and as_dense_mlp_name(parsed[1]) in SWIGLU_PARTS \
        else 1


def layer_key(layer: int, name: str) -> str:
    """``encoder.layers.{layer}.{name}``."""
    return f"{LAYER_PREFIX}{layer}.{name}"


def parse_layer_key(key: str) -> Optional[tuple[int, str]]:
    """``(layer, name inside the layer)`` of a layer's key, None for any other key."""
    m = _LAYER_KEY.fullmatch(key)
    return (int(m.group(1)), m.group(2)) if m else None


def renumber_layer(key: str, offset: int) -> str:
    """A layer's key with its layer number moved by ``offset`` (other keys unchanged)."""
    parsed = parse_layer_key(key)
    return key if parsed is None else layer_key(parsed[0] + offset, parsed[1])


def renumber_expert(key: str, offset: int) -> str:
    """An expert's key with its expert number moved by ``offset`` (a rank's local expert
    ``j`` is global expert ``first_expert + j``); other keys unchanged."""
    m = _EXPERT_NUMBER.fullmatch(key)
    return f"{m[1]}{int(m[2]) + offset}{m[3]}" if m else key


def tp_split_dim(name: str) -> Optional[int]:
    """The dimension tensor ``name`` is split along over tensor-parallel ranks (None:
    replicated)."""
    if name in VOCAB_TENSORS:
        return 0
    parsed = parse_layer_key(name)
    return _TP_DIMS.get(as_dense_mlp_name(parsed[1])) if parsed is not None else None


def chunk_names(config: ModelConfig, num_layers: int, pre_process: bool,
                post_process: bool) -> list[str]:
    """The parameter names of a ``GPTModel`` chunk of ``num_layers`` layers, in its
    ``named_parameters()`` order."""
    names = []
    if pre_process:
        names.append(WORD_EMBEDDINGS)
        if config.position_embedding_type == "learned_absolute":
            names.append(POSITION_EMBEDDINGS)
    moe = config.moe_layers
    for layer in range(num_layers):
        params = [p.name for p in layer_params(config)]
        if moe[layer]:  # layer numbers of a whole model (the first chunk's are the model's)
            params = [n for n in params if not n.startswith("mlp.")] + list(
                expert_params(config))
        names += [layer_key(layer, n) for n in params]
    if post_process:
        names += list(final_norm_names(config))
        if config.untie_embeddings_and_output_weights:
            names.append(OUTPUT_LAYER)
        elif not pre_process:
            names.append(TIED_COPY)
    return names


def model_order_key(name: str) -> tuple:
    """Sort key putting a chunk's names in the order the model registers them."""
    if name == WORD_EMBEDDINGS:
        return (0, 0, 0)
    if name.startswith("embedding."):
        return (0, 1, name)
    parsed = parse_layer_key(name)
    if parsed is not None:
        return (1, parsed[0], *_order_in_layer(parsed[1]))
    return (2, (*FINAL_NORM, OUTPUT_LAYER, TIED_COPY).index(name), 0)


def _order_in_layer(name: str) -> tuple[int, int, int]:
    """Where a layer's tensor comes in the layer: its dense slot, then (in a mixture of
    experts: the router, each expert in turn, the shared expert) its place there."""
    if name in (ROUTER, EXPERT_BIAS):
        return (_LAYER_ORDER["mlp.dense_h_to_4h.weight"], 0, int(name == EXPERT_BIAS))
    if name == SHARED_EXPERT_GATE:
        return (_LAYER_ORDER["mlp.dense_h_to_4h.weight"], 1 << 30, -1)
    m = _EXPERT_KEY.fullmatch(name)
    if m is None:
        return (_LAYER_ORDER[name], 0, 0)
    expert = int(m.group(1)) + 1 if m.group(1) is not None else 1 << 30  # shared: last
    return (_LAYER_ORDER["mlp.dense_h_to_4h.weight"], expert, _LAYER_ORDER[f"mlp.{m.group(2)}"])

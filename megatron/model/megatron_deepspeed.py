"""Megatron-DeepSpeed's (and Megatron-LM's legacy) GPT checkpoint layout, read into ours.

Their ``model_optim_rng.pt`` (same folders and tracker as ours) holds the model as nested
dicts::

    model["language_model"]["embedding"]["word_embeddings"]["weight"]
    model["language_model"]["embedding"]["position_embeddings"]["weight"]
    model["language_model"]["encoder"]["layers.{i}.self_attention.query_key_value.weight"]
    model["language_model"]["encoder"]["final_layernorm.weight"]
    model["language_model"]["output_layer"]["weight"]          (untied embeddings)
    model["word_embeddings_for_head"]["weight"]                (last stage, tied, pp > 1)

(``transformer`` instead of ``encoder`` and ``attention`` instead of ``self_attention`` in
older saves), and the run's flags as an argparse Namespace under ``args``. From
``checkpoint_version`` 3.0 on, their fused QKV rows are ordered per head, as ours are.
"""

from __future__ import annotations

from typing import Any

from megatron.model.names import LAYER_PREFIX, refuse_experts

_PREFIXES = (
    ("language_model.embedding.", "embedding."),
    ("language_model.encoder.final_layernorm.", "final_layernorm."),
    ("language_model.transformer.final_layernorm.", "final_layernorm."),
    ("language_model.encoder.layers.", LAYER_PREFIX),
    ("language_model.transformer.layers.", LAYER_PREFIX),
    ("language_model.output_layer.", "output_layer."),
    ("word_embeddings_for_head.", "word_embeddings."),
)


def is_megatron_deepspeed_model(model_state: dict) -> bool:
    return "language_model" in model_state


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def our_names(model_state: dict) -> dict:
    """A Megatron-DeepSpeed model chunk's state under our chunk names."""
    out = {}
    for name, value in _flatten(model_state).items():
        for theirs, ours in _PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        else:
            raise ValueError(f"unknown Megatron-DeepSpeed model entry {name!r}")
        out[name.replace(".attention.", ".self_attention.")] = value
    return out


# Ours -> the nesting of their model entry: (our prefix, their path of dict keys, the part of
# our name dropped from the key inside that dict).
_NESTING = (
    ("embedding.word_embeddings.", ("language_model", "embedding", "word_embeddings"),
     "embedding.word_embeddings."),
    ("embedding.position_embeddings.", ("language_model", "embedding", "position_embeddings"),
     "embedding.position_embeddings."),
    (LAYER_PREFIX, ("language_model", "encoder"), "encoder."),
    ("final_layernorm.", ("language_model", "encoder"), ""),
    ("output_layer.", ("language_model", "output_layer"), "output_layer."),
)


def their_names(state: dict) -> dict:
    """The inverse of ``our_names`` for a whole model (tp 1, one stage): their nested model
    entry, with the current spellings (``encoder``, ``self_attention``)."""
    out: dict = {}
    for name, value in state.items():
        for ours, path, dropped in _NESTING:
            if name.startswith(ours):
                rest = name[len(dropped):]
                node = out
                for key in path:
                    node = node.setdefault(key, {})
                node[rest] = value
                break
        else:
            raise ValueError(f"no Megatron-DeepSpeed name for parameter {name!r}")
    return out


class MegatronDeepSpeedAdapter:
    """``adapters.StateDictAdapter`` of Megatron-DeepSpeed's nested ``language_model`` entry
    (the same tensors as ours: only the names differ)."""

    name = "megatron_deepspeed"

    def to_ours(self, state: dict, config: Any) -> dict:
        refuse_experts(config, "Megatron-DeepSpeed's layout")
        return our_names(state)

    def from_ours(self, state: dict, config: Any) -> dict:
        refuse_experts(config, "Megatron-DeepSpeed's layout")
        return their_names(state)


MDS = MegatronDeepSpeedAdapter()

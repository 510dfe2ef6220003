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

from megatron.model.names import LAYER_PREFIX

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

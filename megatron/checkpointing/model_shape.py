"""Whether a checkpoint's model has this run's shapes, told from the config saved with it.

Compared before any weight is copied, so a run started with other model flags than the
checkpoint's is told which flags differ instead of getting torch's size-mismatch list.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from megatron.checkpointing.errors import CheckpointError

# Fields that set parameter shapes, and the flag a user sets each with.
_SIZES = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("kv_channels", "--kv-channels"),
    ("position_embedding_type", "--position-embedding-type"),
    ("query_groups", "--num-query-groups"),
    ("normalization", "--normalization"),
)
# Switches: (field, flag, the field's value when the flag is given).
_SWITCHES = (
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", True),
    ("add_bias_linear", "--disable-bias-linear", False),
    ("swiglu", "--swiglu", True),
    ("add_qkv_bias", "--add-qkv-bias", True),
)


def query_groups(fields: dict) -> Any:
    """The key/value heads a stored config means: Megatron-LM keeps --num-query-groups (1 by
    default) even without --group-query-attention, where each head is its own group (ours
    keeps none then)."""
    if not fields.get("group_query_attention"):
        return fields.get("num_attention_heads")
    return fields.get("num_query_groups")


def saved_model_fields(saved_config: Any) -> dict:
    """The model fields of a checkpoint's stored config: ours (``{"model": {...}, ...}``) or
    Megatron's flat argparse fields (``vars(args)``). Empty when there is none."""
    if not isinstance(saved_config, dict):
        return {}
    model = saved_config.get("model")
    fields = dict(model) if isinstance(model, dict) else dict(saved_config)
    if "num_attention_heads" in fields:
        fields["query_groups"] = query_groups(fields)
    if "group_query_attention" in fields and not fields["group_query_attention"]:
        # Megatron-LM's default --num-query-groups 1 means nothing without GQA (not MQA).
        fields["num_query_groups"] = None
    return fields


def check_model_shape(saved_config: Any, model_config: Any, where: str) -> None:
    """Raise ``CheckpointError`` naming every shape flag whose saved value differs from
    ``model_config``'s (this run's ``ModelConfig``). ``where`` names the checkpoint."""
    saved = saved_model_fields(saved_config)
    if not saved:
        return
    differences = [d for d in (_size_differences(saved, model_config)
                               + _switch_differences(saved, model_config)
                               + _vocab_differences(saved, model_config)) if d]
    if differences:
        raise CheckpointError(f"checkpoint {where} has {'; '.join(differences)}: run with the "
                              "checkpoint's model flags")


def _plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _size_differences(saved: dict, model_config: Any) -> list[str]:
    fields = list(_SIZES)
    learned = "learned_absolute"
    if saved.get("position_embedding_type", learned) == learned == \
            getattr(model_config, "position_embedding_type", learned):
        fields.append(("max_position_embeddings", "--max-position-embeddings"))
    out = []
    for field, flag in fields:
        mine, theirs = getattr(model_config, field, None), saved.get(field)
        if _plain(theirs) and _plain(mine) and theirs != mine:
            out.append(f"{flag} {theirs}, you asked for {mine}")
    return out


def _switch_differences(saved: dict, model_config: Any) -> list[str]:
    out = []
    for field, flag, value_when_given in _SWITCHES:
        mine, theirs = getattr(model_config, field, None), saved.get(field)
        if isinstance(theirs, bool) and isinstance(mine, bool) and theirs != mine:
            out.append(f"{flag} {_on_off(theirs, value_when_given)}, you asked for "
                       f"{_on_off(mine, value_when_given)}")
    return out


def _on_off(value: bool, value_when_given: bool) -> str:
    return "on" if value == value_when_given else "off"


def _padded_vocab(fields: dict) -> Optional[int]:
    if isinstance(fields.get("padded_vocab_size"), int):  # Megatron's args
        return fields["padded_vocab_size"]
    try:
        multiple = fields["make_vocab_size_divisible_by"] * fields["tensor_model_parallel_size"]
        return int(math.ceil(fields["vocab_size"] / multiple) * multiple)
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _vocab_differences(saved: dict, model_config: Any) -> list[str]:
    theirs, mine = _padded_vocab(saved), getattr(model_config, "padded_vocab_size", None)
    if theirs is None or mine is None or theirs == mine:
        return []
    of_theirs = f" (vocabulary {saved['vocab_size']})" if "vocab_size" in saved else ""
    return [f"a padded vocabulary of {theirs}{of_theirs}, you asked for {mine} (the "
            f"tokenizer's {model_config.vocab_size} padded to a multiple of "
            f"--make-vocab-size-divisible-by {model_config.make_vocab_size_divisible_by} x "
            f"--tensor-model-parallel-size {model_config.tensor_model_parallel_size})"]

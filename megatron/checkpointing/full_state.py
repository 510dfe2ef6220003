"""A whole checkpoint in memory, at tensor/pipeline size 1 (``FullCheckpoint``): the form every
reader of ``megatron/conversion`` (torch in ``full``, torch_dist, DeepSpeed's engines, Hugging
Face) produces and every writer takes."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.checkpointing.contents import stored_config
from megatron.checkpointing.run_config import config_from_stored
from megatron.config import ModelConfig
from megatron.model.names import VOCAB_TENSORS
from megatron.model.sharding import resize_vocab


@dataclasses.dataclass
class FullCheckpoint:
    """A checkpoint as one tensor-parallel-size-1, single-stage state.

    ``config``: the run configuration as plain dicts (``{"model": {...}, "parallel": {...},
    ...}``) with tp 1 / pp 1; ``model``: ``GPTModel``'s state dict (vocabulary padded for tp 1);
    ``optimizer``: see ``optim_state`` (None when the source had none); ``scheduler``: the
    LR scheduler's state dict; ``extra``: the checkpoint's other top-level entries.
    """

    config: dict
    model: dict
    optimizer: Optional[dict] = None
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    scheduler: Optional[dict] = None
    extra: dict = dataclasses.field(default_factory=dict)
    release: bool = False
    distributed_optimizer: bool = False  # the source's optimizer kind

    def model_config(self, tp: int = 1) -> ModelConfig:
        """The model's ``ModelConfig`` at tensor-parallel size ``tp``."""
        return model_config_from_dict(self.config.get("model", {}), tp)


def model_config_from_dict(fields: dict, tp: int = 1) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: v for k, v in fields.items() if k in known}
    kwargs.update(tensor_model_parallel_size=tp,
                  sequence_parallel=bool(kwargs.get("sequence_parallel")) and tp > 1)
    return ModelConfig(**kwargs)


def source_config(state: dict, theirs: bool, true_vocab_size: Optional[int],
                  where: str) -> dict:
    """The run configuration a file stores, as ours (``{"model": ..., ...}``), at tp 1/pp 1;
    Megatron's flat argparse fields are mapped to our model and tokenizer fields."""
    return config_from_stored(stored_config(state), theirs, true_vocab_size, where)


def repad_vocab(tensors: dict, rows: int) -> dict:
    return {k: resize_vocab(v, rows) if k in VOCAB_TENSORS else v for k, v in tensors.items()}

"""The checkpoint formats, one subpackage each, every one a ``format.Format`` registered at
import: ``torch`` (Megatron's mp_rank_* files), ``torch_dist`` (Megatron-LM's distributed
format), ``deepspeed`` (DeepSpeed's engine folders and universal checkpoints). A new format is
a subpackage here and its import below."""

from megatron.checkpointing.formats import deepspeed, torch, torch_dist  # noqa: F401 - registers

__all__ = ["deepspeed", "torch", "torch_dist"]

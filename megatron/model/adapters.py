"""Other programs' parameter names and ours: one small protocol (``StateDictAdapter``) that
every outside layout follows, as torchtitan's per-model state-dict adapters do.

An adapter turns a whole model's state dict (tensor-parallel size 1, one stage) from the
outside program's names and tensor layouts into ours (``to_ours``) and back (``from_ours``);
``names.py`` owns ours. The adapters:

    hf_gpt2.HF_GPT2             Hugging Face GPT2LMHeadModel
    hf_llama.HF_LLAMA           Hugging Face Llama, Mistral and Qwen2 (LlamaForCausalLM, ...),
                                and the experts of Mixtral and Qwen2-MoE
    megatron_deepspeed.MDS      Megatron-DeepSpeed's (and Megatron-LM's legacy) language_model
                                layout of a model_optim_rng.pt
    mcore_names.MCORE           megatron-core's global tensor names (torch_dist), layers
                                stacked along a leading axis

``ADAPTERS`` finds one by name. A new outside layout is one module with its adapter and its
line here; a format or a converter that reads it calls ``to_ours`` and never spells the
outside names itself.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron.config import ModelConfig
from megatron.model.hf_gpt2 import HF_GPT2
from megatron.model.hf_llama import HF_LLAMA
from megatron.model.mcore_names import MCORE
from megatron.model.megatron_deepspeed import MDS

StateDict = dict[str, torch.Tensor]


class StateDictAdapter(Protocol):
    """One outside layout of a whole model's weights. ``to_ours`` pads the vocabulary to
    ``config.padded_vocab_size`` where the outside keeps the true size; ``from_ours`` drops
    that padding again. ``from_ours(to_ours(sd))`` is ``sd``."""

    name: str

    def to_ours(self, state: StateDict, config: ModelConfig) -> StateDict:
        """Our whole-model state dict from the outside program's."""

    def from_ours(self, state: StateDict, config: ModelConfig) -> StateDict:
        """The outside program's state dict from ours."""


ADAPTERS: dict[str, StateDictAdapter] = {a.name: a for a in (HF_GPT2, HF_LLAMA, MCORE, MDS)}

"""GPT's layers one by one, for a pipeline engine that owns the stages (DeepSpeed's
``PipelineModule``, assembled in megatron/integrations/deepspeed/).

The modules are GPTModel's own (Embedding, ParallelTransformer, the final LayerNorm), built
with the same initialisation streams, so a run through this list computes what GPTModel does.
Between stages only the hidden state ``[s, b, h]`` travels, so the attention mask must be the
causal one (``--reset-attention-mask`` is refused under the pipeline engine).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core import tensor_parallel
from megatron.model.gpt_batch import masked_mean_loss
from megatron.model.gpt_model import Embedding
from megatron.model.init import InitRNG
from megatron.model.layer_norm import build_layer_norm
from megatron.model.rotary import model_rotary_freqs
from megatron.model.transformer import ParallelTransformer


class EmbeddingPipe(Embedding):
    """``(tokens [b, s], position_ids [b, s])`` -> hidden ``[s, b, h]``; with tied embeddings
    the same module on the last stage gives the LM head its weight (``lm_logits``)."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, position_ids = inputs
        return super().forward(tokens, position_ids)


class TransformerLayerPipe(ParallelTransformer):
    """One transformer layer (global number ``layer + 1``): hidden ``[s, b, h]`` in and out."""

    def __init__(self, config: ModelConfig, layer: int, *, device=None) -> None:
        super().__init__(config, layer, 1, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        cfg = self.config
        freqs: Optional[torch.Tensor] = None
        if cfg.position_embedding_type == "rope":
            freqs = model_rotary_freqs(cfg, hidden.size(0), hidden.device)
        return super().forward(hidden, freqs, None)


class FinalLayerNormPipe(nn.Module):
    def __init__(self, config: ModelConfig, *, device=None) -> None:
        super().__init__()
        self.final_layernorm = build_layer_norm(config, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(hidden)


class LMHeadPipe(nn.Module):
    """The untied output layer (--untie-embeddings-and-output-weights): hidden ``[s, b, h]``
    -> logits ``[s, b, V/tp]``; GPTModel's ``output_layer`` (the same initialisation), its
    weight named ``lm_head.weight`` as Megatron-DeepSpeed's ``LMHeadPipe`` names it."""

    def __init__(self, config: ModelConfig, *, device=None) -> None:
        super().__init__()
        self.lm_head = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.padded_vocab_size, bias=False,
            init_method=InitRNG(config, "output_layer").normal(),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
            device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def lm_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on the tied word embeddings: hidden ``[s, b, h]`` -> logits
    ``[s, b, V/tp]`` (this rank's vocabulary shard)."""
    hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    return torch.nn.functional.linear(hidden, embedding.word_embeddings.weight)


def lm_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy where the loss mask is one: logits ``[s, b, V/tp]``, labels and
    loss mask ``[b, s]`` (``masked_mean_loss``, pretrain_gpt.loss_func's reduction)."""
    targets, loss_mask = labels
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets.t())  # [s, b]
    return masked_mean_loss(losses.t(), loss_mask)  # [b, s]

"""GPTModel: GPT-2/GPT-3 as one pipeline stage (or the whole model when there is one stage).

The first stage (``pre_process``) owns the embeddings; the last (``post_process``) owns the
final LayerNorm and the LM head. With tied embeddings a last stage that is not also the first
holds its own copy of the word embeddings (``word_embeddings``, marked ``shared``), drawn from
the same generator as the first stage's so both start identical; their gradients are summed
over the embedding group by the training step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core import context_parallel, tensor_parallel
from megatron.core.tensor_parallel.cross_entropy import (
    LogitsWorkspace,
    linear_vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.layers import linear
from megatron.model.init import InitRNG
from megatron.model.kv_cache import KVCache
from megatron.model.layer_norm import build_layer_norm
from megatron.model.rotary import model_rotary_freqs
from megatron.model.transformer import ParallelTransformer, dropout


class Embedding(nn.Module):
    """Vocab-parallel word embeddings + learned absolute positions -> ``[s, b, h]``."""

    def __init__(self, config: ModelConfig, *, device=None) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size,
            init_method=InitRNG(config, "word_embeddings").normal(),
            params_dtype=config.params_dtype, device=device)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size,
                dtype=config.params_dtype, device=device)
            init = InitRNG(config, "position_embeddings").normal()
            if init is not None and self.position_embeddings.weight.device.type != "meta":
                with torch.no_grad():
                    master = torch.empty(self.position_embeddings.weight.shape)
                    init(master)
                    self.position_embeddings.weight.copy_(master)

    def forward(self, input_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = _local_positions(self.config, input_ids.size(1),
                                                input_ids.device)
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)  # [s/tp, b, h]
        return dropout(x, self.config.hidden_dropout, self.training, self.config.sequence_parallel)


def _local_positions(config: ModelConfig, local_length: int, device) -> torch.Tensor:
    """The global positions of the ``local_length`` tokens this rank holds: all of them from
    0, or under context parallelism its share of the whole sequence."""
    cp = config.context_parallel_size
    positions = (context_parallel.group_positions(local_length * cp, config.context_attention,
                                                  device) if cp > 1 else None)
    return torch.arange(local_length, device=device) if positions is None else positions


class GPTModel(nn.Module):
    """One pipeline stage of GPT.

    Args:
        first_layer, num_layers: the global layers this stage builds (default: all).
        parallel_output: return logits split over the vocabulary (``[b, s, V/tp]``) rather
            than gathered (``[b, s, V]``).

    ``forward(input_ids [b, s], position_ids, attention_mask, labels [b, s])`` returns, on the
    last stage, the per-token loss ``[b, s]`` (fp32) when labels are given, else logits;
    on other stages the hidden state ``[s, b, h]`` for the next stage.

    With ``inference_cache`` (a ``KVCache``; generation, no sequence parallelism) the input is
    the next ``s`` positions after those already cached, positions default to where the cache
    stands, and the last stage returns the logits of the last position only (``[b, 1, V/tp]``).
    """

    def __init__(self, config: ModelConfig, *, pre_process: bool = True,
                 post_process: bool = True, first_layer: int = 0,
                 num_layers: Optional[int] = None, parallel_output: bool = True,
                 device=None) -> None:
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.input_tensor: Optional[torch.Tensor] = None
        num_layers = config.num_layers - first_layer if num_layers is None else num_layers

        if pre_process:
            self.embedding = Embedding(config, device=device)
        self.encoder = ParallelTransformer(config, first_layer, num_layers, device=device)
        if post_process:
            self.final_layernorm = build_layer_norm(config, device=device)
            self._build_output_weight(device)
            self.logits_workspace = LogitsWorkspace()

    def _build_output_weight(self, device) -> None:
        cfg = self.config
        if not self.share_embeddings_and_output_weights:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                cfg.hidden_size, cfg.padded_vocab_size, bias=False,
                init_method=InitRNG(cfg, "output_layer").normal(),
                sequence_parallel=cfg.sequence_parallel, params_dtype=cfg.params_dtype,
                device=device)
        elif not self.pre_process:
            self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                cfg.padded_vocab_size, cfg.hidden_size,
                init_method=InitRNG(cfg, "word_embeddings").normal(),
                params_dtype=cfg.params_dtype, device=device)
            self.word_embeddings.weight.shared = True
            self.word_embeddings.weight.shared_embedding = True

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The hidden state received from the previous stage (pipeline parallelism)."""
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight that the first and last stage share, if this stage has it."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process and self.share_embeddings_and_output_weights:
            return self.word_embeddings.weight
        return None

    def _rotary(self, seq_length: int, device, offset: int = 0) -> Optional[torch.Tensor]:
        """Rotary angles of positions ``[offset, offset + seq_length)``, if RoPE is used
        (under context parallelism: of the global positions of this rank's tokens)."""
        cfg = self.config
        if cfg.position_embedding_type != "rope":
            return None
        if cfg.context_parallel_size > 1:
            positions = _local_positions(cfg, seq_length, device)
            whole = model_rotary_freqs(cfg, seq_length * cfg.context_parallel_size, device)
            return whole.index_select(0, positions)
        return model_rotary_freqs(cfg, offset + seq_length, device)[offset:]

    def forward(self, input_ids: Optional[torch.Tensor],
                position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                inference_cache: Optional[KVCache] = None) -> torch.Tensor:
        if inference_cache is not None:
            return self._forward_cached(input_ids, position_ids, inference_cache)
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        else:
            hidden = self.input_tensor
        seq_length = hidden.size(0) * (self.config.tensor_model_parallel_size
                                       if self.config.sequence_parallel else 1)
        hidden = self.encoder(hidden, self._rotary(seq_length, hidden.device), attention_mask)
        if not self.post_process:
            return hidden
        hidden = self.final_layernorm(hidden)
        return self._lm_head(hidden, labels)

    def _forward_cached(self, input_ids: Optional[torch.Tensor],
                        position_ids: Optional[torch.Tensor], cache: KVCache) -> torch.Tensor:
        """Positions ``[cache.offset, cache.offset + s)`` through this stage; moves the cache
        on. Returns the hidden state ``[s, b, h]``, or on the last stage the last position's
        logits ``[b, 1, V/tp]``."""
        if self.config.sequence_parallel:
            raise ValueError("generation with a KV cache runs without sequence parallelism: "
                             "build the model with sequence_parallel=False")
        if self.pre_process:
            if position_ids is None and self.embedding.position_embeddings is not None:
                s = input_ids.size(1)
                position_ids = torch.arange(cache.offset, cache.offset + s,
                                            device=input_ids.device)
            hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        else:
            hidden = self.input_tensor
        s = hidden.size(0)
        hidden = self.encoder(hidden, self._rotary(s, hidden.device, cache.offset), None, cache)
        cache.advance(s)
        if not self.post_process:
            return hidden
        return self._lm_head(self.final_layernorm(hidden[-1:]), None)  # [b, 1, V/tp]

    def _lm_head(self, hidden: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        if labels is not None:
            return self._lm_loss(hidden, labels)
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
            if self.config.sequence_parallel:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden)
            else:
                hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
            # Through oneDNN's matmul on CPU fp32 (layers.linear): the LM head is most of the
            # time of a generation step.
            logits = linear(hidden, weight)  # [s, b, V/tp]
        else:
            logits = self.output_layer(hidden)  # [s, b, V/tp]
        if not self.parallel_output:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits.transpose(0, 1).contiguous()  # [b, s, V/tp or V]

    def _lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]``: the output layer and the cross entropy fused, so the
        ``[s, b, V/tp]`` logits never exist apart from the softmax (same numbers as
        ``vocab_parallel_cross_entropy`` on the logits)."""
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        else:
            weight = self.output_layer.weight
        if self.config.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden)  # [s, b, h]
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        loss = linear_vocab_parallel_cross_entropy(hidden, weight, labels.t(),
                                                   workspace=self.logits_workspace)  # [s, b]
        return loss.t().contiguous()  # [b, s]

"""The GPT transformer: pre-LayerNorm layers with tensor-parallel attention and MLP.

Activations are ``[s, b, h]`` (sequence first, as in Megatron), or ``[s/tp, b, h]`` between
the tensor-parallel blocks under sequence parallelism. Each rank holds ``heads/tp`` attention
heads and ``ffn/tp`` MLP columns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core import context_parallel, tensor_parallel
from megatron.core.grad_accumulation import refuse_fusion
from megatron.core.tensor_parallel.layers import compiled_fusion_works
from megatron.core.utils import divide
from megatron.model.init import InitRNG
from megatron.model.kv_cache import KVCache
from megatron.model.layer_norm import build_layer_norm
from megatron.model.moe import MoELayer
from megatron.model.rotary import apply_rotary_emb


def _flash_attn_func() -> Optional[Callable]:
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def flash_attn_installed() -> bool:
    """Whether ``--use-flash-attn`` gets the flash_attn package (else PyTorch's SDPA)."""
    return _flash_attn_func() is not None


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout on replicated activations: the same mask on every tensor rank, except under
    sequence parallelism where each rank holds different tokens and draws from its own stream."""
    if not training or p == 0.0:
        return x
    if sequence_parallel:
        return on_tracker_stream(F.dropout, x, p, True)
    return F.dropout(x, p, True)


def on_tracker_stream(fn: Callable, *args):
    """``fn(*args)`` drawing its randomness from the tensor-parallel RNG tracker's stream."""
    if torch.compiler.is_compiling():
        # The tracker swaps generator states, which torch.compile cannot trace: under
        # --compile this runs eagerly between the compiled graphs, so the masks stay the
        # tracker's. Disabled here rather than by a decorator: that would import torch._dynamo
        # (about 2 s) with this module, in every run and every --help.
        return torch.compiler.disable(_forked_tracker_stream)(fn, *args)
    return _forked_tracker_stream(fn, *args)


def _forked_tracker_stream(fn: Callable, *args):
    with tensor_parallel.get_rng_tracker().fork():
        return fn(*args)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v, on this rank's heads.

    q ``[b, n, s, d]``, k and v ``[b, g, s, d]`` (g query groups, g divides n); output
    ``[b, n, s, d]``. ``attention_mask`` (optional, bool,
    ``[b or 1, 1, s, s]``, True = masked out, Megatron's convention) replaces the causal mask.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dropout_p = config.attention_dropout
        # Without the flash_attn package, --use-flash-attn (which GPT-3 recipes pass) runs on
        # PyTorch's SDPA, whose flash kernel serves causal bf16/fp16 attention on a GPU; the
        # training loop says so once.
        self.flash = _flash_attn_func() if config.use_flash_attn else None
        self.softmax_in_fp32 = config.attention_softmax_in_fp32
        # Under context parallelism each rank holds part of the sequence: attention spans the
        # other parts as megatron/core/context_parallel.py's kind says.
        self.context = config.context_attention if config.context_parallel_size > 1 else None

    def forward(self, q, k, v, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        p = self.dropout_p if self.training else 0.0
        if p == 0.0:
            return self._attend(q, k, v, attention_mask, 0.0)
        # Dropout on attention probabilities acts on this rank's own heads: its own stream.
        return on_tracker_stream(self._attend, q, k, v, attention_mask, p)

    def _attend(self, q, k, v, attention_mask, p: float) -> torch.Tensor:
        if self.context is not None:
            if attention_mask is not None:
                raise ValueError("context parallelism attends causally: no attention mask")
            return context_parallel.attention(q, k, v, self.context, p)
        if self.flash is not None and q.is_cuda and attention_mask is None:
            # flash_attn takes fewer key/value heads than query heads as they are.
            out = self.flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             dropout_p=p, causal=True)  # [b, s, n, d]
            return out.transpose(1, 2)
        gqa = k.size(1) != q.size(1)  # key/value heads shared by groups of query heads
        if attention_mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=p,
                                              enable_gqa=gqa)


class ParallelAttention(nn.Module):
    """Self-attention with a fused column-parallel QKV projection and a row-parallel output.

    The QKV weight's output rows are laid out per query group as ``[g, n/g + 2, d]``: the
    group's query heads, then its key head, then its value head (Megatron's layout; with one
    group per head, multi-head attention, ``[n, 3, d]``), so a contiguous split across tensor
    ranks gives each rank whole groups. Key/value heads are not repeated for the query heads:
    the attention kernels take them grouped.
    """

    def __init__(self, config: ModelConfig, init: InitRNG, *, device=None,
                 layer_number: int = 1) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        self.config = config
        self.layer_number = layer_number
        self.heads_per_rank = divide(config.num_attention_heads, tp)
        self.groups_per_rank = divide(config.query_groups, tp)
        self.head_dim = config.kv_channels
        self.rotary_interleaved = config.rotary_interleaved
        common = dict(params_dtype=config.params_dtype, device=device,
                      sequence_parallel=config.sequence_parallel, bias=config.add_bias_linear)
        qkv_width = config.projection_size + 2 * config.kv_projection_size
        self.query_key_value = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, qkv_width, init_method=init.normal(),
            **{**common, "bias": config.add_bias_linear or config.add_qkv_bias})
        self.core_attention = CoreAttention(config)
        self.dense = tensor_parallel.RowParallelLinear(
            config.projection_size, config.hidden_size, init_method=init.scaled_normal(),
            input_is_parallel=True, **common)
        self.recompute_core = config.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, rotary_freqs: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                inference_cache: Optional[KVCache] = None) -> torch.Tensor:
        qkv = self.query_key_value(x)  # [s, b, (n + 2g)/tp * d]
        s, b = qkv.shape[:2]
        g, per_group = self.groups_per_rank, self.heads_per_rank // self.groups_per_rank
        qkv = qkv.view(s, b, g, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(s, b, self.heads_per_rank, self.head_dim)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]  # each [s, b, g/tp, d]
        if rotary_freqs is not None:
            q = apply_rotary_emb(q, rotary_freqs, self.rotary_interleaved)
            k = apply_rotary_emb(k, rotary_freqs, self.rotary_interleaved)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n/tp, s, d]
        if inference_cache is not None:
            out = self._attend_cached(q, k, v, inference_cache)
        elif self.recompute_core and self.training:
            if attention_mask is None:
                out = tensor_parallel.checkpoint(self.core_attention, q, k, v)
            else:
                out = tensor_parallel.checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            out = self.core_attention(q, k, v, attention_mask)  # [b, n/tp, s, d]
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.dense(out)  # [s, b, h]

    def _attend_cached(self, q, k, v, cache: KVCache) -> torch.Tensor:
        """Attention of the new positions ``[offset, offset + s)`` over every cached one.

        SDPA's ``is_causal`` aligns the mask to the top left, right only when queries and
        keys start together, so later chunks of several positions get an explicit mask.
        """
        start, s = cache.offset, q.size(2)
        keys, values = cache.append(self.layer_number, k, v)  # [b, g/tp, start + s, d]
        gqa = keys.size(1) != q.size(1)
        if s == 1:
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        if start == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                                  enable_gqa=gqa)
        allowed = torch.ones(s, start + s, dtype=torch.bool, device=q.device).tril(start)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                              enable_gqa=gqa)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel); with --swiglu the first
    projection is 2 x ffn wide, each rank's part its gate rows then its up rows
    (``[gate_r; up_r]``, Megatron's), and silu(gate) * up goes on."""

    def __init__(self, config: ModelConfig, init: InitRNG, *, device=None,
                 ffn_hidden_size: Optional[int] = None,
                 sequence_parallel: Optional[bool] = None) -> None:
        """``ffn_hidden_size``/``sequence_parallel``: other than the config's (experts)."""
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_hidden_size
        sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
        common = dict(params_dtype=config.params_dtype, device=device,
                      sequence_parallel=sp, bias=config.add_bias_linear)
        self.swiglu = config.swiglu
        width = 2 * ffn if config.swiglu else ffn
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, width, init_method=init.normal(),
            parts=2 if config.swiglu else 1, **common)
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            ffn, config.hidden_size, init_method=init.scaled_normal(),
            input_is_parallel=True, **common)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)  # [s, b, ffn/tp] (SwiGLU: [s, b, 2 ffn/tp])
        return self.dense_4h_to_h(self.activate(y))  # [s, b, h]

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        """The activation between the two projections (``[..., 2 ffn/tp] -> [..., ffn/tp]``
        under SwiGLU)."""
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate=self.approximate)


class ParallelTransformerLayer(nn.Module):
    """x + drop(attn(ln(x))), then + drop(mlp(ln(.))). ``layer_number`` is global, 1-based."""

    def __init__(self, config: ModelConfig, layer_number: int, *, device=None) -> None:
        super().__init__()
        self.layer_number = layer_number
        init = InitRNG(config, f"layer{layer_number}")
        self.input_layernorm = build_layer_norm(config, device=device)
        self.self_attention = ParallelAttention(config, init, device=device,
                                                layer_number=layer_number)
        self.post_attention_layernorm = build_layer_norm(config, device=device)
        if config.moe_layers[layer_number - 1]:
            self.mlp = MoELayer(config, layer_number, ParallelMLP, device=device)
        else:
            self.mlp = ParallelMLP(config, init, device=device)
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor, rotary_freqs: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                inference_cache: Optional[KVCache] = None) -> torch.Tensor:
        drop = self.hidden_dropout
        y = self.self_attention(self.input_layernorm(x), rotary_freqs, attention_mask,
                                inference_cache)
        x = x + dropout(y, drop, self.training, self.sequence_parallel)
        y = self.mlp(self.post_attention_layernorm(x))
        return x + dropout(y, drop, self.training, self.sequence_parallel)


class ParallelTransformer(nn.Module):
    """The layers of one pipeline stage (or virtual chunk): global layers
    ``[first_layer, first_layer + num_layers)``, with optional full activation recompute."""

    def __init__(self, config: ModelConfig, first_layer: int, num_layers: int, *,
                 device=None) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(config, first_layer + i + 1, device=device)
            for i in range(num_layers)
        )

    def _segment(self, start: int, end: int, freqs, mask,
                 cache: Optional[KVCache] = None) -> Callable:
        """Layers [start, end) as a function of the hidden state alone, for checkpointing
        (the rotary table and mask never need gradients, so the closure may hold them)."""
        def run(x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[start:end]:
                x = layer(x, freqs, mask, cache)
            return x
        return run

    def forward(self, x: torch.Tensor, rotary_freqs: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                inference_cache: Optional[KVCache] = None) -> torch.Tensor:
        """``inference_cache``: decode incrementally (see ``KVCache``); no recompute then."""
        cfg, n = self.config, len(self.layers)
        if inference_cache is not None:
            return self._segment(0, n, rotary_freqs, attention_mask, inference_cache)(x)
        if cfg.recompute_granularity != "full" or not self.training:
            return self._segment(0, n, rotary_freqs, attention_mask)(x)
        k = cfg.recompute_num_layers or 1
        if cfg.recompute_method == "uniform":
            # Checkpoint groups of k layers; only each group's input is stored.
            for start in range(0, n, k):
                end = min(start + k, n)
                x = tensor_parallel.checkpoint(
                    self._segment(start, end, rotary_freqs, attention_mask), x)
            return x
        # "block": checkpoint each of the first k layers of the stage, run the rest normally.
        for i in range(n):
            segment = self._segment(i, i + 1, rotary_freqs, attention_mask)
            x = tensor_parallel.checkpoint(segment, x) if i < k else segment(x)
        return x


def compile_transformer_layers(module: nn.Module) -> int:
    """``torch.compile`` every transformer layer inside ``module`` in place (parameter names
    and checkpoints unchanged); returns how many. Each layer is one graph on its own: the
    embedding, the LM head with its fused loss, pipeline exchanges and recomputation stay
    eager around them. Layers share their compiled code (same shapes, same structure)."""
    layers = [m for m in module.modules() if isinstance(m, ParallelTransformerLayer)]
    keep_fusion = compiled_fusion_works() if layers else True
    for layer in layers:
        if not keep_fusion:  # this torch cannot: the compiled layers' weights go unfused
            for param in layer.parameters():
                refuse_fusion(param)
        layer.compile()
    return len(layers)

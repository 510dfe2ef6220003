"""FLOPs of one training iteration (forward + backward, a matmul of m x k by k x n counted as
2mkn), for B sequences of s tokens, L layers, hidden h, FFN width f, attention projection
width a (= heads x kv_channels), key/value width k (= query groups x kv_channels; a without
grouped-query attention), m = 2 matmuls into the FFN with SwiGLU (gate, up; else 1) and
padded vocabulary V::

    per token, forward:  L * (2*h*(a + 2k)  +  2*a*h  +  2*(m + 1)*h*f  +  2*2*s*a)  +  2*h*V
                              qkv              proj      MLP              scores, weighted sum
    training:            3 x forward (backward costs twice the forward)

A mixture-of-experts layer's MLP term is its router's 2*h*E plus the MLP term of the k
experts each token is routed to (width k x --moe-ffn-hidden-size) and the shared expert
(with its gate's 2*h under --moe-shared-expert-gate).
With f = 4h and a = h this is Megatron's ``72 B s L h^2 (1 + s/(6h) + V/(12 h L))``. We report
*model* FLOPs: recomputed activations are not counted, so TFLOP/s is comparable across
recompute settings (MFU, not HFU).
"""

from __future__ import annotations

from typing import Optional

from megatron.config import ModelConfig


def flops_per_token(config: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Training FLOPs per token (forward + backward) of the formula in the module docstring."""
    s = seq_length or config.seq_length
    h, f, a = config.hidden_size, config.ffn_hidden_size, config.projection_size
    k, into = config.kv_projection_size, 2 if config.swiglu else 1
    attention = 2 * h * (a + 2 * k) + 2 * a * h + 4 * s * a
    moe_layers = sum(config.moe_layers)
    dense = (config.num_layers - moe_layers) * 2 * (into + 1) * h * f
    moe = moe_layers * _moe_mlp_flops(config) if moe_layers else 0
    forward = config.num_layers * attention + dense + moe + 2 * h * config.padded_vocab_size
    return 3.0 * forward


def _moe_mlp_flops(config: ModelConfig) -> float:
    """Forward FLOPs per token of one mixture-of-experts layer: the router (h x E), the top-k
    experts each token goes through, and the shared expert."""
    h, into = config.hidden_size, 2 if config.swiglu else 1
    width = config.moe_router_topk * config.moe_ffn_hidden_size + (
        config.moe_shared_expert_intermediate_size or 0)
    gate = 2 * h if config.moe_shared_expert_gate else 0
    return 2 * h * config.num_experts + 2 * (into + 1) * h * width + gate

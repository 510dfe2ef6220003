"""FLOPs of one training iteration (forward + backward, a matmul of m x k by k x n counted as
2mkn), for B sequences of s tokens, L layers, hidden h, FFN width f, attention projection
width a (= heads x kv_channels), key/value width k (= query groups x kv_channels; a without
grouped-query attention), m = 2 matmuls into the FFN with SwiGLU (gate, up; else 1) and
padded vocabulary V::

    per token, forward:  L * (2*h*(a + 2k)  +  2*a*h  +  2*(m + 1)*h*f  +  2*2*s*a)  +  2*h*V
                              qkv              proj      MLP              scores, weighted sum
    training:            3 x forward (backward costs twice the forward)

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
    per_layer = 2 * h * (a + 2 * k) + 2 * a * h + 2 * (into + 1) * h * f + 4 * s * a
    forward = config.num_layers * per_layer + 2 * h * config.padded_vocab_size
    return 3.0 * forward

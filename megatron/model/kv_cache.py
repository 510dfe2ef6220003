"""The key/value cache of incremental decoding: each layer's keys and values of the positions
already run, so that a new token costs one position instead of the whole sequence.

One ``KVCache`` serves one generation batch on one pipeline stage. The model appends to it
as it runs (``GPTModel.forward(..., inference_cache=cache)``) and moves ``offset`` on by the
positions it ran; attention then reads keys and values ``[0, offset + s)``.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value buffers ``[b, g/tp, max_sequence_length, d]`` (g key/value heads:
    the query groups), filled from the left.

    ``offset`` is the number of positions already in the cache (the position of the next
    token). Buffers are allocated on first use with the keys' dtype and device, so the same
    cache serves fp32, bf16 and fp16 models on any device.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError("a KVCache needs a positive batch size and sequence length")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.offset = 0
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, layer_number: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ``[b, n, s, d]`` at positions ``[offset, offset + s)`` of layer
        ``layer_number``; return the layer's keys and values ``[b, n, offset + s, d]``."""
        b, n, s, d = k.shape
        end = self.offset + s
        if b > self.max_batch_size or end > self.max_sequence_length:
            raise ValueError(f"KVCache holds {self.max_batch_size} sequences of "
                             f"{self.max_sequence_length} positions; asked for {b} up to "
                             f"position {end}")
        if layer_number not in self._layers:
            shape = (self.max_batch_size, n, self.max_sequence_length, d)
            self._layers[layer_number] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self._layers[layer_number]
        keys[:b, :, self.offset:end] = k
        values[:b, :, self.offset:end] = v
        return keys[:b, :, :end], values[:b, :, :end]

    def advance(self, positions: int) -> None:
        """The model ran ``positions`` more positions through every layer of this stage."""
        self.offset += positions

    def reset(self) -> None:
        """Start a new batch (the buffers are kept and overwritten)."""
        self.offset = 0

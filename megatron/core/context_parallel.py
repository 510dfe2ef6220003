"""Context parallelism: the ranks of a context group split each sequence, and attention spans
the pieces (Megatron-LM's --context-parallel-size with --cp-comm-type, and DeepSpeed-Ulysses'
--ds-sequence-parallel-size).

Which tokens a rank holds (``local_positions``):

- ``p2p``, ``a2a``, ``allgather``: the sequence is cut into ``2N`` chunks and rank ``i`` holds
  chunks ``i`` and ``2N-1-i``, so every rank has the same share of the causal attention's work;
- ``ulysses``: rank ``i`` holds the ``i``-th of ``N`` contiguous shards (DeepSpeed's layout).

How attention sees the rest (``attention``):

- ``p2p`` (ring attention, ``RingAttention``): keys and values travel round the ring; each
  rank attends its queries to every block as it passes and merges the partial results by
  their log-sum-exp. The backward pass sends the key/value gradients round the ring behind
  their blocks, so each arrives back at its owner. Nothing of size ``s x s`` is kept.
- ``a2a`` and ``ulysses``: an all-to-all turns sequence shards into head shards (every rank
  then holds the whole sequence for ``heads / N`` heads), ordinary causal attention runs, and
  the inverse all-to-all turns them back. Key/value heads fewer than ``N`` are repeated first.
- ``allgather``: every rank gathers all keys and values and attends its own queries to them.

Everything else about the model is per token and needs no exchange, except the positions
(rotary angles and learned position embeddings use each token's global position) and the loss,
whose sum and token count are totalled over the context group (``megatron.model.gpt_batch``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state

LOAD_BALANCED = ("p2p", "a2a", "allgather")


# Which tokens a rank holds ------------------------------------------------------------------


def chunk_ids(size: int, rank: int, kind: str) -> tuple[int, ...]:
    """The chunks of a sequence cut into ``2 * size`` (load-balanced kinds) or ``size``
    (``ulysses``) that ``rank`` holds, in the order it holds them."""
    if kind == "ulysses":
        return (rank,)
    return (rank, 2 * size - 1 - rank)


def local_positions(seq_length: int, size: int, rank: int, kind: str,
                    device=None) -> torch.Tensor:
    """The global positions of the ``seq_length / size`` tokens ``rank`` holds, in order."""
    ids = chunk_ids(size, rank, kind)
    chunk = seq_length // (len(ids) * size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in ids])


def group_positions(seq_length: int, kind: str, device=None) -> Optional[torch.Tensor]:
    """``local_positions`` of this rank in its context group (None without one)."""
    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    return local_positions(seq_length, size, parallel_state.get_context_parallel_rank(), kind,
                           device)


def shard(tensor: Optional[torch.Tensor], seq_dim: int, kind: str) -> Optional[torch.Tensor]:
    """This rank's tokens of ``tensor`` (the whole sequence along ``seq_dim``)."""
    if tensor is None:
        return None
    positions = group_positions(tensor.size(seq_dim), kind, tensor.device)
    return tensor if positions is None else tensor.index_select(seq_dim, positions)


def gathered_order(size: int, kind: str) -> Optional[torch.Tensor]:
    """For the tokens of every rank concatenated in rank order: the index of each global
    position in that concatenation, in chunk units (None when they are in order already)."""
    if kind == "ulysses":
        return None
    held = [c for rank in range(size) for c in chunk_ids(size, rank, kind)]
    return torch.tensor([held.index(c) for c in range(2 * size)])


# Attention -------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence of its context group.

    ``q`` ``[b, n, s/N, d]``, ``k`` and ``v`` ``[b, g, s/N, d]`` (g key/value heads, g divides
    n), each holding this rank's tokens (``local_positions``); returns ``[b, n, s/N, d]``.
    """
    group = parallel_state.get_context_parallel_group()
    if kind == "p2p":
        if dropout_p:
            raise ValueError("ring attention (--cp-comm-type p2p) has no attention dropout")
        return RingAttention.apply(q, k, v, group)
    if kind in ("a2a", "ulysses"):
        return _all_to_all_attention(q, k, v, group, kind, dropout_p)
    if kind == "allgather":
        return _all_gather_attention(q, k, v, group, dropout_p)
    raise ValueError(f"unknown context-parallel attention {kind!r}")


def _chunk_order_permute(x: torch.Tensor, order: Optional[torch.Tensor], dim: int,
                         inverse: bool = False) -> torch.Tensor:
    """Reorder the equal chunks of ``x`` along ``dim``: chunk ``order[i]`` goes to place
    ``i`` (``inverse``: back)."""
    if order is None:
        return x
    chunks = x.chunk(len(order), dim)
    if inverse:
        placed = [None] * len(order)
        for i, j in enumerate(order.tolist()):
            placed[j] = chunks[i]
        return torch.cat(placed, dim)
    return torch.cat([chunks[j] for j in order.tolist()], dim)


def _all_to_all_attention(q, k, v, group, kind: str, dropout_p: float) -> torch.Tensor:
    size = dist.get_world_size(group)
    n, g = q.size(1), k.size(1)
    if g % size:  # too few key/value heads to share out: one per query head (DeepSpeed's way)
        k, v = (t.repeat_interleave(n // g, dim=1) for t in (k, v))
    order = gathered_order(size, kind)
    # [b, heads, s/N, d] -> [b, heads/N, s, d], the sequence in global order.
    q, k, v = (_chunk_order_permute(_AllToAll.apply(t, 1, 2, group), order, 2)
               for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                         enable_gqa=k.size(1) != q.size(1))
    return _AllToAll.apply(_chunk_order_permute(out, order, 2, inverse=True), 2, 1, group)


def _all_gather_attention(q, k, v, group, dropout_p: float) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    s = q.size(2) * size
    order = gathered_order(size, "allgather")
    k, v = (_chunk_order_permute(_AllGather.apply(t, 2, group), order, 2) for t in (k, v))
    mine = local_positions(s, size, rank, "allgather", q.device)
    allowed = torch.arange(s, device=q.device)[None, :] <= mine[:, None]  # [s/N, s]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                          enable_gqa=k.size(1) != q.size(1))


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into N pieces along ``scatter_dim``, send piece i to rank i, and join what
    arrives along ``gather_dim`` in rank order; the gradient goes back the inverse way."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    pieces = torch.stack(x.chunk(size, scatter_dim)).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)
    return torch.cat(received.unbind(0), gather_dim)


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` joined along ``dim`` in rank order; the gradient of each piece is
    the sum of every rank's gradient of it."""

    @staticmethod
    def forward(ctx, x, dim: int, group):
        ctx.dim, ctx.group = dim, group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx, grad):
        # gloo has no reduce-scatter: the whole gradient is summed and this rank's piece kept.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, ctx.dim)[rank].contiguous(), None, None


# Ring attention --------------------------------------------------------------------------


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the load-balanced chunks (module docstring, ``p2p``).

    Each rank's queries and its current key/value block are two chunks each; a pair of
    chunks (query chunk x, key chunk y) is attended in full when y < x, causally when y == x,
    and skipped when y > x. Block results are merged in fp32 by their log-sum-exp; the
    backward pass recomputes each block's probabilities from the final log-sum-exp, which
    gives each block's exact share of the gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.size(-1))
        q_ids = chunk_ids(size, rank, "p2p")
        q_parts = q.chunk(2, dim=2)
        outs = [torch.zeros(p.shape, dtype=_acc(q.dtype), device=q.device) for p in q_parts]
        lses = [torch.full(p.shape[:-1], -math.inf, dtype=_acc(q.dtype), device=q.device)
                for p in q_parts]
        ring = _Ring(group)
        block = (k, v)
        for step in range(size):
            if step + 1 < size:
                ring.start(block)
            owner = (rank - step) % size
            k_parts, v_parts = block[0].chunk(2, dim=2), block[1].chunk(2, dim=2)
            for i, x in enumerate(q_ids):
                for j, y in enumerate(chunk_ids(size, owner, "p2p")):
                    if y > x:
                        continue
                    out, lse = _block_forward(q_parts[i], k_parts[j], v_parts[j], scale,
                                              causal=(y == x))
                    outs[i], lses[i] = _merge(outs[i], lses[i], out, lse)
            if step + 1 < size:
                block = ring.finish()
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_ids = chunk_ids(size, rank, "p2p")
        dout = dout.to(_acc(q.dtype))
        # D_i = sum_j P_ij dP_ij = rowsum(dout * out): the softmax's backward term.
        delta = (dout * out).sum(-1)
        parts = [t.chunk(2, dim=2) for t in (q, dout, lse, delta)]
        dq_parts = [torch.zeros(p.shape, dtype=_acc(q.dtype), device=q.device)
                    for p in parts[0]]
        ring = _Ring(group)
        block = (k, v, torch.zeros(k.shape, dtype=_acc(q.dtype), device=k.device),
                 torch.zeros(v.shape, dtype=_acc(q.dtype), device=v.device))
        for step in range(size):
            owner = (rank - step) % size
            kb, vb, dk, dv = block
            k_parts, v_parts = kb.chunk(2, dim=2), vb.chunk(2, dim=2)
            dk_parts, dv_parts = list(dk.chunk(2, dim=2)), list(dv.chunk(2, dim=2))
            for i, x in enumerate(q_ids):
                for j, y in enumerate(chunk_ids(size, owner, "p2p")):
                    if y > x:
                        continue
                    dqx, dky, dvy = _block_backward(
                        parts[0][i], k_parts[j], v_parts[j], parts[1][i], parts[2][i],
                        parts[3][i], scale, causal=(y == x))
                    dq_parts[i] += dqx
                    dk_parts[j] += dky
                    dv_parts[j] += dvy
            block = (kb, vb, torch.cat(dk_parts, dim=2), torch.cat(dv_parts, dim=2))
            # The gradients of a block follow it round the ring; after the last step one
            # more hop brings them home. Keys and values need not travel that hop.
            ring.start(block if step + 1 < size else block[2:])
            block = ring.finish()
        dk, dv = block  # this rank's own block's gradients, home from the last hop
        dq = torch.cat(dq_parts, dim=2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _grouped(q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[b, n, s, d]`` as ``[b, g, n/g, s, d]`` and ``kv`` ``[b, g, s, d]`` as
    ``[b, g, 1, s, d]``: each key/value head broadcast over its group of query heads."""
    b, n, s, d = q.shape
    g = kv.size(1)
    return q.reshape(b, g, n // g, s, d), kv.unsqueeze(2)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores ``[b, g, n/g, sq, sk]`` in fp32, -inf above the diagonal if causal."""
    qg, kg = _grouped(q, k)
    acc = _acc(q.dtype)
    scores = torch.matmul(qg.to(acc), kg.to(acc).transpose(-1, -2)) * scale
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, -math.inf)
    return scores


def _block_forward(q, k, v, scale: float, causal: bool):
    """Attention of ``q`` over one block alone: its output (fp32, ``[b, n, s, d]``) and the
    log-sum-exp of each query's scores (``[b, n, s]``)."""
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(probs, v.to(_acc(q.dtype)).unsqueeze(2))  # [b, g, n/g, s, d]
    return out.flatten(1, 2), lse.flatten(1, 2)


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint keys, as one: weights exp(lse_i - lse)."""
    merged = torch.logaddexp(lse, block_lse)
    # A query that has seen nothing yet has lse -inf: its weight is zero (not NaN).
    old = torch.where(torch.isinf(lse), torch.zeros_like(lse), torch.exp(lse - merged))
    new = torch.exp(block_lse - merged)
    return out * old.unsqueeze(-1) + block_out * new.unsqueeze(-1), merged


def _block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool):
    """One block's share of the gradients, from the final log-sum-exp ``lse`` and
    ``delta = rowsum(dout * out)``: (dq, dk, dv) in fp32."""
    b, n, s, d = q.shape
    g = k.size(1)
    probs = torch.exp(_scores(q, k, scale, causal) - lse.reshape(b, g, n // g, s, 1))
    dout_g = dout.reshape(b, g, n // g, s, d)
    dv = torch.matmul(probs.transpose(-1, -2), dout_g).sum(2)  # [b, g, sk, d]
    dprobs = torch.matmul(dout_g, v.to(_acc(q.dtype)).unsqueeze(2).transpose(-1, -2))
    dscores = probs * (dprobs - delta.reshape(b, g, n // g, s, 1)) * scale
    dq = torch.matmul(dscores, k.to(_acc(q.dtype)).unsqueeze(2)).flatten(1, 2)
    qg, _ = _grouped(q, k)
    dk = torch.matmul(dscores.transpose(-1, -2), qg.to(_acc(q.dtype))).sum(2)
    return dq, dk, dv


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results accumulate in: fp32, or the inputs' if wider."""
    return torch.promote_types(dtype, torch.float32)


class _Ring:
    """Sends tensors to the next rank of the context group and receives the previous rank's,
    started before a block's compute and finished after it."""

    def __init__(self, group) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
        self.requests: list = []
        self.received: tuple = ()

    def start(self, tensors) -> None:
        tensors = [t.contiguous() for t in tensors]
        self.received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def finish(self) -> tuple:
        for request in self.requests:
            request.wait()
        self.requests = []
        return self.received

"""Flat-tensor collectives under the names the installed torch prefers.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and warns (FutureWarning) on every call of the
old names; older releases have only the old names. Every caller goes through here, so no run
prints torch's deprecation warnings and every torch version works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


# Looked up at each call, not bound at import: a wrapper of torch.distributed (the rehearsal's
# recorder, megatron/rehearsal) must see these calls too.
def _all_gather() -> Any:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter() -> Any:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: Any,
                    async_op: bool = False) -> Any:
    """``output`` (dim 0 = shard's x group size) <- every rank's ``shard`` in rank order."""
    return _all_gather()(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group: Any,
                        async_op: bool = False) -> Any:
    """``output`` <- this rank's slice (in rank order, along dim 0) of the sum of ``full``."""
    return _reduce_scatter()(output, full, group=group, async_op=async_op)

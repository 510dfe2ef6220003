"""The random generators a checkpoint saves and restores: python, numpy, torch CPU/CUDA and
the tensor-parallel tracker, one entry per data-parallel rank."""

from __future__ import annotations

import logging
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpointing.ranks import RankLayout
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.platform import xla

logger = logging.getLogger(__name__)



def _computes_on_cuda() -> bool:
    """Whether this run's generators include CUDA's (saved and restored only then)."""
    return parallel_state.get_default_device().type == "cuda"


def _computes_on_xla() -> bool:
    return parallel_state.get_default_device().type == "xla"


def capture_rng_state() -> dict:
    """Every generator this rank draws from, as tensors and plain values."""
    version, internal, gauss_next = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    cuda = _computes_on_cuda()
    return {
        "random_rng_state": [version, list(internal), gauss_next],
        "np_rng_state": {"algorithm": algorithm, "keys": torch.from_numpy(keys.astype(np.int64)),
                         "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached_gaussian)},
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if cuda else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
        # An XLA device's generator (dropout there): one seed, which its draws advance.
        "xla_rng_state": xla.rng_state() if _computes_on_xla() else None,
    }


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``; also takes Megatron's raw tuples and arrays."""
    version, internal, gauss_next = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["np_rng_state"]
    if isinstance(np_state, dict):
        keys = np_state["keys"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np_state = (np_state["algorithm"], keys.astype(np.uint32), np_state["pos"],
                    np_state["has_gauss"], np_state["cached_gaussian"])
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and _computes_on_cuda():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("xla_rng_state") is not None and _computes_on_xla():
        xla.set_rng_state(state["xla_rng_state"])
    tracker = get_rng_tracker()
    if tracker.fits(state["rng_tracker_states"]):
        tracker.set_states(state["rng_tracker_states"])
    else:
        # Saved on a GPU and loaded on the CPU, or the reverse: a CUDA generator's state
        # cannot seed a CPU one. Only dropout inside tensor-parallel regions draws from it.
        logger.warning("the checkpoint's tensor-parallel RNG states come from another device "
                       "type than this run's (%s): that dropout stream restarts from its seed",
                       tracker.device_type)


def gather_rng_states(layout: RankLayout) -> list[dict]:
    """Every data-parallel rank's RNG state, in data-parallel rank order (collective)."""
    mine = capture_rng_state()
    if layout.dp_size == 1:
        return [mine]
    gathered: list[Any] = [None] * layout.dp_size
    # An XLA run's data-parallel group is torch_xla's, for XLA tensors only; its data-parallel
    # ranks are every rank (no tensor or pipeline parallelism there), whose host group is gloo.
    control = parallel_state.get_control_group()
    group = control if control is not None else layout.dp_group
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def rng_state_for(state: dict, layout: RankLayout, path: str) -> Optional[dict]:
    """This rank's RNG entry of a checkpoint (ours: per dp rank; Megatron-DS: top level)."""
    if "rng_state" in state:
        entries = state["rng_state"]
        if len(entries) != layout.dp_size:
            # Saved at another data-parallel size: replicas draw the same numbers, take rank 0's.
            logger.info("%s holds RNG states of %d data-parallel ranks, this run has %d: using "
                        "data-parallel rank 0's", path, len(entries), layout.dp_size)
            return entries[0]
        return entries[layout.dp_rank]
    if "random_rng_state" in state:
        return state
    return None


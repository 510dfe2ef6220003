"""Run a function on N spawned ranks with real gloo process groups, and collect results.

Every multi-process test goes through ``run_distributed``: it picks a free port, spawns the
ranks, initializes torch.distributed (gloo) in each, and returns each rank's return value.
If a rank raises, the others are stopped and the failing rank's traceback is re-raised here.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Modules the fork server imports once, so that each rank it forks starts with them loaded
# (a spawned rank spends seconds of CPU importing torch and the framework again). The server
# runs nothing else: no process group, no threads, none of pytest's state. (torch._dynamo:
# torch.optim imports it as a rank builds its first optimizer, 1.5 s of CPU.)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "megatron.training",
            "pretrain_gpt", "tests.distributed.training_utils"]


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
            results: Any, env: dict) -> None:
    # A forked server's ranks carry the environment it started with: take the caller's own.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensors: torch's queue would share them by handles that die
        # with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass
        # A forked rank ends by os._exit, which skips what a program's own end runs (the
        # --save lock's release, for one): run it here, as a rank of a real run would.
        atexit._run_exitfuncs()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0,
                    env: dict | None = None, start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the values.
    The ranks see this process's environment with ``env`` on top. By default they are forked
    from a server that has imported torch and the framework once (``_PRELOAD``); ``"spawn"``
    starts each from nothing."""
    if start_method not in ("forkserver", "spawn"):  # a fork of pytest carries its state
        raise ValueError(f"start_method {start_method!r}: forkserver or spawn")
    ctx = _context(start_method)
    results = ctx.Queue()
    port = free_port()
    environment = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, environment),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [values[r] for r in range(world_size)]

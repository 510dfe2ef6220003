"""Where the ranks of one torchrun attempt meet, so that a restarted attempt finds its own.

Why this exists. Under ``torchrun --max-restarts N`` the agent keeps one TCPStore for the
whole job (static rendezvous creates it once; c10d rendezvous shares its own store with the
workers) and tells the workers so (``TORCHELASTIC_USE_AGENT_STORE=True``). torch's ``env://``
rendezvous then connects every attempt to that store without a per-attempt prefix (torch 2.4
and later; older versions prefixed ``TORCHELASTIC_RESTART_COUNT``). The keys a dead attempt
left there, gloo's listening addresses and NCCL's unique id under ``default_pg/...``, are read
by the next attempt: a new rank connects to a port of the dead one ("Gloo connectFullMesh
failed ... Connection refused") or waits for a peer that will never come (a hang in
``init_process_group``). A 15-line gloo script shows it without this project's code.

The restart count cannot simply become the prefix: each node's agent keeps its own, and an
agent whose workers were healthy when another node failed restarts them without counting
(pytorch/pytorch#135712), so two nodes can start the same attempt with different counts.

So the attempt agrees on a key of its own. Global rank 0 (torchrun's rendezvous gives every
attempt a rank 0) publishes a fresh token; every other rank reads the token, announces itself
under it with a nonce of its own, and waits for rank 0 to answer that nonce. A token a dead
attempt left behind is never answered, so a rank that read one reads again until it finds the
live token. Every key of the attempt's process groups then lives under that token.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from collections.abc import Mapping

import torch.distributed as dist

LEADER_KEY = "megatron/attempt/leader"
# How long a rank waits for an answer under a token before it reads the token again (the one
# it read may be a dead attempt's, while the live rank 0 is still starting up).
_ANSWER_POLL = 1.0  # seconds


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """Whether torchelastic's agent hosts the store this worker must use (torchrun)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_count(env: Mapping[str, str]) -> int:
    """How many times this node's torchrun agent restarted its workers (0: first attempt)."""
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta,
                  env: Mapping[str, str] = os.environ) -> dist.Store:
    """The agent's store (at MASTER_ADDR:MASTER_PORT) under a prefix only this attempt uses."""
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    token = agree_on_token(store, rank, world_size, timeout)
    return dist.PrefixStore(f"megatron/attempt/{token}/", store)


def agree_on_token(store: dist.Store, rank: int, world_size: int,
                   timeout: datetime.timedelta) -> str:
    """A token every rank of this attempt returns and no earlier attempt used (see above)."""
    if rank == 0:
        return _lead(store, world_size, timeout)
    return _follow(store, rank, timeout)


def _lead(store: dist.Store, world_size: int, timeout: datetime.timedelta) -> str:
    token = uuid.uuid4().hex
    store.set(LEADER_KEY, token)
    for rank in range(1, world_size):
        joined = f"{token}/joined/{rank}"
        _wait(store, joined, timeout, f"rank {rank} to join this attempt")
        nonce = store.get(joined).decode()
        store.set(f"{token}/answer/{nonce}", "1")
    return token


def _follow(store: dist.Store, rank: int, timeout: datetime.timedelta) -> str:
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        _wait(store, LEADER_KEY, timeout, "rank 0 to start this attempt")
        token = store.get(LEADER_KEY).decode()
        store.set(f"{token}/joined/{rank}", nonce)
        if _answered(store, f"{token}/answer/{nonce}"):
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} for rank 0 of this attempt to answer rank "
                               f"{rank} (--distributed-timeout-minutes)")


def _answered(store: dist.Store, key: str) -> bool:
    """Whether ``key`` appears within ``_ANSWER_POLL`` (polled: a timed-out ``wait`` would
    log a warning each time a rank reads a dead attempt's token)."""
    give_up = time.monotonic() + _ANSWER_POLL
    while time.monotonic() < give_up:
        if store.check([key]):
            return True
        time.sleep(0.05)
    return store.check([key])


def _wait(store: dist.Store, key: str, timeout: datetime.timedelta, what: str) -> None:
    try:
        store.wait([key], timeout)
    except dist.DistStoreError:
        raise TimeoutError(f"waited {timeout} for {what} (--distributed-timeout-minutes)"
                           ) from None

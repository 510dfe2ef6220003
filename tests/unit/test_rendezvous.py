"""How the ranks of one torchrun attempt meet in the agent's long-lived store
(megatron/platform/rendezvous.py), on a real TCPStore with one client per rank (threads).

The end-to-end proof, torchrun restarting workers killed with SIGKILL, is in
tests/functional/test_torchrun_faults.py and benchmarks/torchrun_restarts.py.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from megatron.platform import rendezvous
from tests.dist_utils import free_port

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def agent_store():
    """The store a torchrun agent keeps for the whole job; returns a client factory."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=TIMEOUT,
                           wait_for_workers=False)

    def client() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=TIMEOUT)

    yield client
    del server


def _attempt(client, world_size: int, start_order: list[int]) -> list[str]:
    """Every rank of one attempt agrees on a token; ranks start in ``start_order``, each a
    moment after the previous one (a rank 0 that starts last finds a dead attempt's token)."""
    tokens: dict[int, str] = {}
    errors: list[BaseException] = []
    started: dict[int, threading.Event] = {r: threading.Event() for r in range(world_size)}

    def rank_main(rank: int) -> None:
        try:
            store = client()
            started[rank].set()
            tokens[rank] = rendezvous.agree_on_token(store, rank, world_size, TIMEOUT)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = []
    for rank in start_order:
        thread = threading.Thread(target=rank_main, args=(rank,))
        thread.start()
        threads.append(thread)
        started[rank].wait(10)
        threading.Event().wait(0.3)  # the next rank starts later
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return [tokens[r] for r in range(world_size)]


def test_every_rank_of_an_attempt_agrees_on_one_token(agent_store):
    tokens = _attempt(agent_store, 3, [0, 1, 2])
    assert len(set(tokens)) == 1


@pytest.mark.slow
def test_a_restarted_attempt_never_takes_the_dead_attempts_token(agent_store):
    """The second attempt's followers start before its rank 0 and read the first attempt's
    token, which nobody answers any more: they read again and meet the new rank 0."""
    first = _attempt(agent_store, 3, [0, 1, 2])[0]
    second = _attempt(agent_store, 3, [2, 1, 0])
    assert len(set(second)) == 1 and second[0] != first
    third = _attempt(agent_store, 3, [1, 0, 2])
    assert len(set(third)) == 1 and third[0] not in (first, second[0])


def test_a_missing_rank_0_ends_in_an_error_naming_the_flag(agent_store):
    short = datetime.timedelta(seconds=1)
    with pytest.raises(TimeoutError, match="--distributed-timeout-minutes"):
        rendezvous.agree_on_token(agent_store(), 1, 2, short)


def test_only_torchruns_agent_store_is_used():
    assert rendezvous.uses_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not rendezvous.uses_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not rendezvous.uses_agent_store({})  # srun, deepspeed, one process
    assert rendezvous.restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert rendezvous.restart_count({}) == 0

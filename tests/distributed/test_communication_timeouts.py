"""A communication that waits past --distributed-timeout-minutes is named in one line: the
group, the operation, when, and the ranks that did not arrive (megatron/core/timeouts.py).

Two real gloo ranks, groups made by parallel_state with a timeout of 1.2 s. Without the
timeout on the groups these tests would wait torch's default 30 minutes (run_distributed
gives up after 60 s). The whole run under torchrun, with a rank stopped by SIGSTOP, is in
tests/functional/test_torchrun_faults.py.
"""

from __future__ import annotations

import datetime
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, timeouts
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow
SHORT = 0.02  # minutes: 1.2 s
GRACE = 2.0  # seconds a timed-out rank waits for the others' reports


def _store():
    return dist.distributed_c10d._get_default_store()


def _describe(error: BaseException) -> str:
    assert timeouts.is_timeout(error), error
    return timeouts.describe_timeout(error, "the training step of iteration 7", grace=GRACE)


def _fresh_groups(tp: int, pp: int, scenario: str) -> None:
    """New groups for the next scenario (a timed-out gloo group is closed); the reports of
    the last one are cleared (a real run has one timeout per attempt and store)."""
    _store().set(f"test/{scenario}/ready/{dist.get_rank()}", "1")
    _store().wait([f"test/{scenario}/ready/{r}" for r in range(2)],
                  datetime.timedelta(seconds=50))
    for rank in range(2):
        _store().delete_key(f"megatron/timed-out/{rank}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, distributed_timeout_minutes=SHORT)


def _alone(rank: int, scenario: str, wait) -> Optional[str]:
    """Rank 0 runs ``wait`` and describes its timeout; rank 1 stays silent meanwhile."""
    done = f"test/{scenario}/done"
    if rank == 1:
        _store().wait([done], datetime.timedelta(seconds=50))
        return None
    try:
        wait()
        line = "no timeout"
    except RuntimeError as error:
        line = _describe(error)
    _store().set(done, "1")
    return line


def _silent_rank(rank: int) -> Optional[str]:
    """Rank 1 never joins rank 0's second all-reduce, and reports nothing (as if stopped)."""
    _fresh_groups(2, 1, "silent")
    group = parallel_state.get_tensor_model_parallel_group()
    dist.all_reduce(torch.ones(4), group=group)  # both arrive: #1
    return _alone(rank, "silent", lambda: dist.all_reduce(torch.ones(4), group=group))


def _waiting_elsewhere(rank: int) -> str:
    """Rank 0 all-reduces over the tensor-parallel group, rank 1 over the model-parallel
    group: both time out and each names the other and where it waits."""
    _fresh_groups(2, 1, "elsewhere")
    group = (parallel_state.get_tensor_model_parallel_group() if rank == 0
             else parallel_state.get_model_parallel_group())
    try:
        dist.all_reduce(torch.ones(4), group=group)
        return "no timeout"
    except RuntimeError as error:
        return _describe(error)


def _silent_next_stage(rank: int) -> Optional[str]:
    """The first pipeline stage waits for gradients the second stage never sends."""
    _fresh_groups(1, 2, "pipeline")
    p2p = P2PCommunicator((4, 2, 8), torch.float32, torch.device("cpu")) if rank == 0 else None
    return _alone(rank, "pipeline", lambda: p2p.recv_backward())


def _scenarios(rank, world_size) -> dict:
    # One pair of processes for all three: starting them is most of the cost.
    return {"silent": _silent_rank(rank), "elsewhere": _waiting_elsewhere(rank),
            "pipeline": _silent_next_stage(rank)}


@pytest.fixture(scope="module")
def lines():
    return run_distributed(_scenarios, 2, timeout=120)


def test_a_silent_rank_is_named_with_the_group_and_the_operation(lines):
    line = lines[0]["silent"]
    assert line.startswith("[rank 0] all_reduce #2 on TENSOR_MODEL_PARALLEL_GROUP (ranks 0-1) "
                           "timed out after 0.02 min (--distributed-timeout-minutes) during "
                           "the training step of iteration 7; "), line
    assert line.endswith("did not arrive: rank 1 (no report: stopped, dead, or busy outside "
                         "communication)"), line


def test_a_rank_waiting_in_another_collective_is_named_with_where_it_waits(lines):
    first, second = lines[0]["elsewhere"], lines[1]["elsewhere"]
    assert "[rank 0] all_reduce #1 on TENSOR_MODEL_PARALLEL_GROUP" in first
    assert first.endswith("did not arrive: rank 1 (waiting in all_reduce #1 on "
                          "MODEL_PARALLEL_GROUP)"), first
    assert "[rank 1] all_reduce #1 on MODEL_PARALLEL_GROUP" in second
    assert second.endswith("did not arrive: rank 0 (waiting in all_reduce #1 on "
                           "TENSOR_MODEL_PARALLEL_GROUP)"), second


def test_a_pipeline_transfer_names_the_stage_it_waits_for(lines):
    line = lines[0]["pipeline"]
    assert line.startswith("[rank 0] recv of gradients from rank 1 on "
                           "PIPELINE_MODEL_PARALLEL_GROUP timed out after 0.02 min"), line
    assert line.endswith("did not arrive: rank 1 (no report: stopped, dead, or busy outside "
                         "communication)"), line

"""Under --deepspeed, the process groups DeepSpeed's engine makes (its pipeline grid's) carry
--distributed-timeout-minutes too, and a rank that does not arrive in one is named as in our
own groups (megatron/core/timeouts.py; tests/distributed/test_communication_timeouts.py has
the groups parallel_state makes). Two gloo ranks, DeepSpeed's pipeline engine at data
parallel 2, a save included (DeepSpeed could make more groups there)."""

from __future__ import annotations

import datetime
import shutil

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron.core import parallel_state, timeouts
from tests.dist_utils import run_distributed
from tests.distributed.test_deepspeed_engine import argv

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("deepspeed") is None,
                                 reason="deepspeed is not installed")]
TIMEOUT = 0.1  # minutes: 6 s


def _timeouts() -> dict[str, tuple[str, list[int], datetime.timedelta]]:
    """Every group of this rank: name -> (description, ranks, timeout)."""
    found = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        if group is dist.GroupMember.WORLD:
            continue  # made by the test's harness, not by the run
        backend = group._get_backend(torch.device("cpu"))
        found[name] = (group.group_desc, dist.get_process_group_ranks(group),
                       backend.options._timeout)
    return found


def _run(rank: int, world_size: int, save: str) -> dict:
    pretrain_gpt.main(argv(**{"--deepspeed": True, "--zero-stage": 1, "--train-iters": 2,
                              "--lr-decay-iters": 2, "--eval-iters": 0, "--save": save,
                              "--save-interval": 1,
                              "--distributed-timeout-minutes": TIMEOUT}))
    groups = _timeouts()
    deepspeeds = [name for name, (desc, ranks, _) in groups.items()
                  if desc == "undefined" and ranks == [0, 1]]
    store = dist.distributed_c10d._get_default_store()
    line = None
    if rank == 0:  # rank 1 never joins: it waits for rank 0's word on the store
        group = next(g for g, n in dist.distributed_c10d._world.pg_names.items()
                     if n == deepspeeds[0])
        try:
            dist.all_reduce(torch.ones(2), group=group)
        except RuntimeError as error:
            assert timeouts.is_timeout(error), error
            line = timeouts.describe_timeout(error, "the training step of iteration 7",
                                             grace=2.0)
        store.set("test/done", "1")
    else:
        store.wait(["test/done"], datetime.timedelta(seconds=120))
    parallel_state.destroy_model_parallel()
    return {"groups": groups, "deepspeeds": deepspeeds, "line": line}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_run, 2, str(tmp_path_factory.mktemp("ds") / "ckpt"), timeout=600)


def test_deepspeeds_groups_carry_the_distributed_timeout(ranks):
    for result in ranks:
        assert result["deepspeeds"], result["groups"]  # the pipeline grid made some
        for name, (desc, _, timeout) in result["groups"].items():
            assert timeout == datetime.timedelta(minutes=TIMEOUT), (name, desc, timeout)


def test_a_rank_missing_in_a_deepspeed_group_is_named(ranks):
    name = ranks[0]["deepspeeds"][0]
    line = ranks[0]["line"]
    assert line is not None
    assert line.startswith("[rank 0] all_reduce #") and (
        f" on DeepSpeed's group {name} (ranks 0-1) timed out after 0.1 min "
        "(--distributed-timeout-minutes) during the training step of iteration 7; ") in line, line
    assert line.endswith("did not arrive: rank 1 (no report: stopped, dead, or busy outside "
                         "communication)"), line

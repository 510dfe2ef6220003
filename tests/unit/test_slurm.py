"""srun as a launcher: node lists expanded in Python, and each task's rank, world, local rank
and rendezvous computed from fake SLURM variables (8 nodes x 8 GPUs)."""

from __future__ import annotations

import re

import pytest

from megatron.config import parse_args
from megatron.platform.launch_env import distributed_env, launched_by_srun, rendezvous_env
from megatron.platform.slurm import DEFAULT_MASTER_PORT, expand_nodelist, first_host


@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu[001-008]", [f"gpu00{i}" for i in range(1, 9)]),
    ("a1,b2", ["a1", "b2"]),
    ("n[1-2,5],m7", ["n1", "n2", "n5", "m7"]),
    ("node7", ["node7"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("r[1-2]-g[01-02]", ["r1-g01", "r1-g02", "r2-g01", "r2-g02"]),
    ("x[9],y[1-2],z", ["x9", "y1", "y2", "z"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist,message", [
    ("gpu[001-", "'[' without ']'"), ("gpu]1[", "']' without '['"),
    ("gpu[5-2]", "runs backwards"), ("gpu[a-b]", "bad range"), ("", "names no host"),
])
def test_bad_node_lists_are_named(nodelist, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        expand_nodelist(nodelist)


def _srun_task(procid: int, nodes: int = 8, gpus: int = 8, nodelist: str = "gpu[001-008]",
               **extra: str) -> dict[str, str]:
    """The variables srun sets in task ``procid`` of ``--nodes nodes --ntasks-per-node gpus``."""
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(nodes * gpus),
            "SLURM_LOCALID": str(procid % gpus), "SLURM_NODEID": str(procid // gpus),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(gpus),
            "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "4242", **extra}


def test_8_nodes_x_8_gpus_give_64_ranks_meeting_at_the_first_host():
    hosts = expand_nodelist("gpu[001-008]")
    seen = set()
    for procid in range(64):
        env = _srun_task(procid)
        assert launched_by_srun(env)
        info = distributed_env(env)
        assert info == {"rank": procid, "world_size": 64, "local_rank": procid % 8}
        assert rendezvous_env(env) == {"MASTER_ADDR": "gpu001",
                                       "MASTER_PORT": str(DEFAULT_MASTER_PORT)}
        seen.add((hosts[int(env["SLURM_NODEID"])], info["local_rank"]))
    assert len(seen) == 64  # one task per GPU: each (host, GPU) exactly once


def test_the_configuration_sees_the_srun_world(monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _srun_task(17).items():
        monkeypatch.setenv(name, value)
    cfg = parse_args(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
                      "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size",
                      "16", "--tensor-model-parallel-size", "8",
                      "--pipeline-model-parallel-size", "8"], require_training=False)
    assert (cfg.parallel.world_size, cfg.parallel.data_parallel_size) == (64, 1)
    assert cfg.num_microbatches == 16


def test_user_values_win_and_the_step_node_list_comes_first():
    env = _srun_task(3, MASTER_ADDR="head", MASTER_PORT="7100")
    assert rendezvous_env(env) == {"MASTER_ADDR": "head", "MASTER_PORT": "7100"}
    env = _srun_task(3, nodelist="n[1-2,5],m7", SLURM_STEP_NODELIST="n[2,5]")
    assert rendezvous_env(env)["MASTER_ADDR"] == "n2"
    env = _srun_task(0, nodelist="a1,b2")
    assert rendezvous_env(env)["MASTER_ADDR"] == "a1"


def test_torchrun_or_deepspeed_inside_an_allocation_keeps_its_own_ranks():
    env = _srun_task(5, RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", MASTER_PORT="29500")
    assert not launched_by_srun(env)
    assert distributed_env(env) == {"rank": 2, "world_size": 4, "local_rank": 2}
    assert rendezvous_env(env) == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_missing_node_list_or_port_is_an_error_naming_it():
    env = _srun_task(0)
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(RuntimeError, match="SLURM_JOB_NODELIST"):
        rendezvous_env(env)
    with pytest.raises(RuntimeError, match="SLURM_JOB_NODELIST: node list 'gpu\\[1-'"):
        rendezvous_env(_srun_task(0, nodelist="gpu[1-"))
    with pytest.raises(RuntimeError, match="MASTER_PORT is not set"):
        rendezvous_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_single_process_emulation_uses_the_given_port():
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": "6123", "RANK": "0", "LOCAL_RANK": "0"}
    assert distributed_env(env) == {"rank": 0, "world_size": 1, "local_rank": 0}
    assert rendezvous_env(env) == {"MASTER_ADDR": "localhost", "MASTER_PORT": "6123"}

"""NCCL's async error handling as megatron/assembly/initialize.py sets it before an NCCL group is made:
"clean up only" (2), so that NCCL's watchdog aborts the communicators but leaves the process to
the rank's own thread, which prints the one-line timeout report (megatron/core/watchdog.py) and
exits; the user's own choice, in either spelling, is kept, and torchrun's default for its
workers (1, which takes the process down first) is not a choice. The report itself on NCCL is
tests/gpu/test_nccl_timeout.py (two GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron.platform.launch_env import nccl_error_handling_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SET = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "job"}


@pytest.mark.parametrize("env,launcher_env,expected", [
    ({}, None, SET),  # nobody chose: clean up only
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, None, {}),  # the user's choice
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, None, {}),  # ... outside torchrun too
    ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, None, {}),  # the older spelling
    ({**TORCHRUN, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {}, SET),  # torchrun's default
    ({**TORCHRUN, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, None, SET),  # agent unreadable
    ({**TORCHRUN, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
     {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {}),  # the user gave torchrun 1
    ({**TORCHRUN, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {}, {}),
    ({**TORCHRUN, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_ASYNC_ERROR_HANDLING": "1"},
     {}, {}),
], ids=["unset", "user-3", "user-1", "old-spelling", "torchrun-default", "torchrun-unread",
        "torchrun-user-1", "torchrun-user-3", "torchrun-old-spelling"])
def test_the_mode_is_set_only_where_nobody_chose_one(env, launcher_env, expected):
    assert nccl_error_handling_env(env, launcher_env) == expected


WORKER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    from megatron.platform.launch_env import nccl_error_handling_env, parent_env
    print(json.dumps(nccl_error_handling_env(os.environ, parent_env())), flush=True)
""")


@pytest.mark.parametrize("given,expected", [(None, SET), ("1", {})],
                         ids=["torchrun-default", "user-set-1"])
def test_under_a_real_torchrun(tmp_path, given, expected):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=REPO))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")}
    if given is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = given
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "1", "--rdzv-backend", "static", "--master-port", "0", str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected

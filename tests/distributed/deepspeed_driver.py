"""Several pretrain_gpt.py trainings in one launch of the real ``deepspeed`` launcher.

DeepSpeed's import and the launcher's start-up cost seconds each, so the DeepSpeed tests run
their trainings one after the other in the same ranks: ``deepspeed --num_gpus N
tests/distributed/deepspeed_driver.py`` with ``DS_TEST_SPEC`` naming a JSON file
``{"out": path, "runs": [{"name": ..., "argv": [...]}, ...]}``. Between runs the
model-parallel groups are torn down (the process group stays). Rank 0 writes
``{name: {"train": [[iteration, lm loss, grad norm], ...], "valid": last validation lm loss}}``
to ``out``. A run may also name ``"damage": [source folder, copy, file in the copy]``: before
it, rank 0 copies the folder and flips one byte in the middle of that file; a run that then
stops with an error records ``{"error": message}`` instead (and the next run goes on), as does
one with ``"expect_error": true``. An entry ``{"name": ..., "commands": [[argv], ...]}`` trains
nothing: rank 0 runs the commands (each must succeed; e.g. DeepSpeed's ds_to_universal.py on a
checkpoint an earlier run saved) while the other ranks wait.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import torch
import torch.distributed as dist


def main() -> None:
    import pretrain_gpt
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    with open(os.environ["DS_TEST_SPEC"]) as f:
        spec = json.load(f)
    results = {}
    for run in spec["runs"]:
        if "commands" in run:
            _run_on_rank0(run["commands"])
            continue
        if "damage" in run:
            _damaged_copy(*run["damage"])
        try:
            state = pretrain_gpt.main(run["argv"])
        except Exception as error:  # noqa: BLE001 - recorded for the test to check
            if "damage" not in run and not run.get("expect_error"):
                raise
            results[run["name"]] = {"error": f"{type(error).__name__}: {error}"}
        else:
            results[run["name"]] = {
                "train": [[h["iteration"], h["losses"].get("lm loss"), h["grad_norm"]]
                          for h in state.history],
                "valid": state.last_valid_losses.get("lm loss")}
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)


def _run_on_rank0(commands: list[list[str]]) -> None:
    failed = [None]
    if dist.get_rank() == 0:
        for command in commands:
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode != 0:
                failed[0] = f"{command}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
                break
    dist.broadcast_object_list(failed, src=0)  # every rank stops when one command failed
    assert failed[0] is None, failed[0]


def _damaged_copy(source: str, copy: str, rel: str) -> None:
    if dist.get_rank() == 0:
        shutil.copytree(source, copy)
        with open(os.path.join(copy, rel), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(copy, rel)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()


if __name__ == "__main__":
    main()

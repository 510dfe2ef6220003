"""Several pretrain_gpt.py trainings in one launch of the real ``deepspeed`` launcher.

DeepSpeed's import and the launcher's start-up cost seconds each, so the DeepSpeed tests run
their trainings one after the other in the same ranks: ``deepspeed --num_gpus N
tests/distributed/deepspeed_driver.py`` with ``DS_TEST_SPEC`` naming a JSON file
``{"out": path, "runs": [{"name": ..., "argv": [...]}, ...]}``. Between runs the
model-parallel groups are torn down (the process group stays). Rank 0 writes
``{name: {"train": [[iteration, lm loss, grad norm], ...], "valid": last validation lm loss}}``
to ``out``.
"""

from __future__ import annotations

import json
import os

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
        state = pretrain_gpt.main(run["argv"])
        results[run["name"]] = {
            "train": [[h["iteration"], h["losses"].get("lm loss"), h["grad_norm"]]
                      for h in state.history],
            "valid": state.last_valid_losses.get("lm loss")}
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

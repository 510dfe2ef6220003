"""pretrain_gpt.py whose background write of one checkpoint can be held, so that a test can
kill or signal the run while that save is in flight.

``MEGATRON_TEST_HOLD_SAVE=ITERATION:SECONDS:MARK_FILE``: the write of ITERATION's checkpoint
creates MARK_FILE, then sleeps SECONDS before writing anything. Otherwise it is
``python pretrain_gpt.py`` (its ``error: ...`` handling included).
"""

import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.checkpointing.formats.torch import save as save_module  # noqa: E402


def _hold(iteration: int, seconds: float, mark: str) -> None:
    write = save_module.TorchSaveJob.write

    def held_write(job):
        if job.iteration == iteration:
            with open(mark, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(seconds)
        return write(job)

    save_module.TorchSaveJob.write = held_write


if __name__ == "__main__":
    hold = os.environ.get("MEGATRON_TEST_HOLD_SAVE")
    if hold:
        it, seconds, mark = hold.split(":", 2)
        _hold(int(it), float(seconds), mark)
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

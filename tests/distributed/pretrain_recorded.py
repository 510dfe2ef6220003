"""pretrain_gpt.py, plus this rank's per-iteration history written as exact floats.

Run it as pretrain_gpt.py is run (``python -m torch.distributed.run ... THIS_FILE <flags>``,
or directly); with ``MEGATRON_TEST_HISTORY=DIR`` each rank writes ``DIR/rank{RANK}.json``
(``TrainState.history``: its last 1000 iterations) when pretrain() returns. Subprocess tests compare those bit for bit:
the log line's 7 digits cannot show that two runs are identical.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_gpt  # noqa: E402


def main() -> None:
    state = pretrain_gpt.main()
    folder = os.environ.get("MEGATRON_TEST_HISTORY")
    if folder:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(list(state.history), f)


if __name__ == "__main__":
    main()

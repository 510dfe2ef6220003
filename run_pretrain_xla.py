"""Pretrain GPT on TPUs and other XLA devices: pretrain_gpt.py on every XLA device of this host.

    PJRT_DEVICE=TPU python run_pretrain_xla.py --mp-start-method spawn --use-syncfree-optim \
        --bf16 <Megatron flags>
    PJRT_DEVICE=CUDA GPU_NUM_DEVICES=2 python run_pretrain_xla.py --use-syncfree-optim ...

The same as ``python pretrain_gpt.py --device xla --xla-processes 0 ...``: one replica per
device that PJRT shows (torch_xla.launch), data parallel over them through the ``xla``
backend. ``--xla-processes N`` given here takes N devices instead; under torchrun (one
process per device already) it trains in each process as pretrain_gpt.py does.
"""

from __future__ import annotations

import sys

import pretrain_gpt


def xla_argv(argv: list[str]) -> list[str]:
    """``argv`` with the XLA device and every local device asked for, unless it says."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = [] if "--device" in given else ["--device", "xla"]
    extra += [] if "--xla-processes" in given else ["--xla-processes", "0"]
    return extra + argv


if __name__ == "__main__":
    from megatron.checkpointing import CheckpointError

    try:
        pretrain_gpt.main(xla_argv(sys.argv[1:]))
    except CheckpointError as error:  # a damaged or mismatched checkpoint: its message is all
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
